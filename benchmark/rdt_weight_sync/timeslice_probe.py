"""How long one process's small GPU operations wait while another process
keeps the same GPU busy (two processes on one GPU take turns in time slices).

A rank colocated with its trainer shares the GPU with the trainer's own work:
any host-side wait of the rank on the GPU (a pageable upload, a synchronize)
then costs a turn of the other process, not the operation's own time. This
probe measures three such waits, idle and while a second process clones
64 MiB or 512 MiB tensors in a loop:

* ``h2d_pageable``: a 64-entry int64 upload from pageable host memory
  (``tensor.to("cuda")``, which returns once the stream drained);
* ``tiny_kernel_sync``: a one-element kernel and a stream synchronize;
* ``copy_32mib_sync``: a 32 MiB device copy and a synchronize.

usage (a CUDA machine): ``python benchmark/rdt_weight_sync/timeslice_probe.py``
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.multiprocessing as mp

SAMPLES = 100


def _keep_busy(ready, stop, mib: int) -> None:
    torch.cuda.set_device(0)
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    live = []
    ready.set()
    while not stop.is_set():
        live.append(src.clone())
        if len(live) > 3:
            live.pop(0)
        torch.cuda.synchronize()


def _probe(label: str) -> None:
    host = np.arange(64, dtype=np.int64)
    one = torch.zeros(1, dtype=torch.int64, device="cuda")
    src = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ops = {
        "h2d_pageable": lambda: torch.from_numpy(host).to("cuda"),
        "tiny_kernel_sync": lambda: (one.add_(1), torch.cuda.synchronize()),
        "copy_32mib_sync": lambda: (dst.copy_(src), torch.cuda.synchronize()),
    }
    times = {k: [] for k in ops}
    for _ in range(SAMPLES):
        for name, op in ops.items():
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
        time.sleep(0.002)  # (apart, as a rank's operations are)
    for name, v in times.items():
        ms = np.array(v) * 1e3
        print(f"{label:>28}  {name:>16}: median {np.median(ms):.3f} ms, p90 {np.percentile(ms, 90):.3f}, "
              f"max {ms.max():.3f}", flush=True)


def main() -> None:
    mp.set_start_method("spawn")
    torch.cuda.set_device(0)
    _probe("idle GPU")
    for mib in (64, 512):
        ready, stop = mp.Event(), mp.Event()
        other = mp.Process(target=_keep_busy, args=(ready, stop, mib))
        other.start()
        ready.wait()
        time.sleep(0.5)  # (the other process in its loop)
        _probe(f"another process clones {mib} MiB")
        stop.set()
        other.join()


if __name__ == "__main__":
    main()
