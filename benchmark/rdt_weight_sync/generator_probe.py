"""How steady a trainer's stream generator is on its own, update after update.

A MoE stream's update is as fast as the trainer makes its tensors (the rank
waits between pulls), so its slowest update follows the generator. This
probe makes the MoE workload's steps as ``update()`` consumes a stream — 19
steps of 162 new 3 MiB tensors, two buckets' worth alive, a synchronize per
step — in one process, with no client, 16 updates each way:

* ``default``: new tensors from PyTorch's default caching allocator;
* ``pool``: from a ``torch.cuda.MemPool`` grown once to 2.125 GiB (as the
  client's staging pool is);
* ``pool+copier`` / ``default+copier``: the same while another process
  copies 486 MiB on the same GPU every ~2 ms (as a colocated rank does).

It prints each update's time and the generator's share, the median and the
slowest over the median. usage (a CUDA machine):
``python benchmark/rdt_weight_sync/generator_probe.py``
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.multiprocessing as mp

STEPS, PER_STEP, IN_FLIGHT, UPDATES = 19, 162, 4, 16


def _copier(ready, stop) -> None:
    torch.cuda.set_device(0)
    a = torch.empty(486 << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ready.set()
    while not stop.is_set():
        b.copy_(a)
        torch.cuda.synchronize()
        time.sleep(0.0015)


def _updates(base, pool):
    out = []
    for _ in range(UPDATES):
        torch.cuda.synchronize()
        alive, made, k = [], 0.0, 0
        t0 = time.perf_counter()
        for _ in range(STEPS):
            if len(alive) >= IN_FLIGHT:
                alive.pop(0)
            g0 = time.perf_counter()
            with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
                step = [base[(k + i) % len(base)].clone() for i in range(PER_STEP)]
            made += time.perf_counter() - g0
            torch.cuda.synchronize()
            alive.append(step)
            k += PER_STEP
        alive.clear()
        out.append(((time.perf_counter() - t0) * 1e3, made * 1e3))
    total = [t for t, _ in out]
    med = statistics.median(total)
    return out, med, max(total) / med


def _show(name, result) -> None:
    out, med, worst = result
    print(f"{name}: median {med:.1f} ms, slowest {worst:.2f}x the median; update (generator) ms: "
          + " ".join(f"{t:.1f} ({g:.1f})" for t, g in out), flush=True)


def main() -> None:
    torch.cuda.set_device(0)
    base = [torch.randn(768, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(STEPS * PER_STEP)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        block = torch.empty((2 << 30) + (128 << 20), dtype=torch.uint8, device="cuda")
    del block  # (the pool keeps the segment)
    _show("default", _updates(base, None))
    _show("pool", _updates(base, pool))
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_copier, args=(ready, stop))
    proc.start()
    try:
        ready.wait(120)
        _show("pool+copier", _updates(base, pool))
        _show("default+copier", _updates(base, None))
    finally:
        stop.set()
        proc.join(30)


if __name__ == "__main__":
    main()
