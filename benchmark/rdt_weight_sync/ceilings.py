"""What the hardware allows for a workload: copies in one process, no weight sync.

GPU (source and target on the GPUs the run uses): one tensor of the whole
workload's size (the ratio everything is reported against), a per-tensor
``copy_`` loop, one copy-engine call per tensor, one ``cuMemcpyBatchAsync``
and the product's SM copy kernel (``transport/cuda_driver.py``: one launch
over every tensor). CPU: memcpy, one thread and all threads. Every copy's
bytes are checked once.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from patterns import Pattern, words_of


def median_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> Tuple[float, List[float]]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def enable_peer_access(drv, from_ordinal: int, to_ordinal: int) -> None:
    """Let GPU ``from_ordinal``'s context read ``to_ordinal``'s memory (once enabled, enabling again is fine)."""
    from sglang.srt.ray.rdt.transport import cuda_driver

    with cuda_driver.pushed(drv, from_ordinal):
        rc = drv.cuCtxEnablePeerAccess(ctypes.c_void_p(drv.primary_ctx(to_ordinal)), 0)
        if rc not in (0, 704):  # 704: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            drv.check("cuCtxEnablePeerAccess", rc)


def cuda_ceilings(specs, src_idx: int, dst_idx: int, reps: int) -> Dict[str, Any]:
    import numpy as np

    from sglang.srt.ray.rdt.transport import cuda_driver

    d0, d1 = torch.device("cuda", src_idx), torch.device("cuda", dst_idx)
    src = [torch.empty(s, dtype=d, device=d0) for _, s, d in specs]
    dst = [torch.empty(s, dtype=d, device=d1) for _, s, d in specs]
    Pattern(src).fill(src, 1)  # not zeros
    nbytes = sum(t.nbytes for t in src)
    kind = "device copy" if src_idx == dst_idx else "peer copy"
    out: Dict[str, Any] = {"bytes": nbytes}

    def sync():
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)

    def row(key: str, label: str, fn: Callable[[], None]) -> None:
        def run():
            fn()
            sync()

        for d in dst:
            d.zero_()
        sync()
        run()
        ok = all(torch.equal(words_of(d), words_of(s).to(d.device)) for d, s in zip(dst, src))
        t, ts = median_time(run, reps)
        out[key] = {"seconds": t, "all": ts, "label": label, "bytes_ok": ok}

    row("torch_per_tensor", f"{kind}, per-tensor loop (torch copy_)",
        lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dst, src)])
    drv = cuda_driver.driver()
    if src_idx != dst_idx:
        enable_peer_access(drv, dst_idx, src_idx)
    dptr = np.array([d.data_ptr() for d in dst], np.int64)
    sptr = np.array([s.data_ptr() for s in src], np.int64)
    size = np.array([s.nbytes for s in src], np.int64)
    stream = torch.cuda.Stream(device=d1)

    def ce():
        drv.push(dst_idx)
        try:
            for d, s, n in zip(dptr.tolist(), sptr.tolist(), size.tolist()):
                drv.memcpy_async(d, s, n, stream.cuda_stream)
        finally:
            drv.pop()
        stream.synchronize()

    row("ce_per_tensor", "copy engine, one call per tensor", ce)

    def batch():
        drv.push(dst_idx)
        try:
            cuda_driver.memcpy_batch(drv, dptr, sptr, size, stream.cuda_stream, src_idx, dst_idx)
        finally:
            drv.pop()
        stream.synchronize()

    try:
        row("ce_batch", "copy engine, one cuMemcpyBatchAsync", batch)
    except Exception as e:  # pragma: no cover - a driver without it
        out["ce_batch_error"] = f"{type(e).__name__}: {e}"
    kernel = cuda_driver.copy_kernel(dst_idx)
    table = kernel.table(dptr, sptr, size)  # (on d1's current stream)
    torch.cuda.synchronize(d1)
    row("kernel", "SM copy kernel, one launch (the product's)",
        lambda: (kernel.launch(table.data_ptr(), table.numel() // 3, stream.cuda_stream), stream.synchronize()))
    del src, dst, table
    torch.cuda.empty_cache()
    bs = torch.empty(nbytes, dtype=torch.uint8, device=d0)
    bd = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    bs.fill_(0x5A)
    t, ts = median_time(lambda: (bd.copy_(bs, non_blocking=True), sync()), reps)
    out["one_tensor"] = {"seconds": t, "all": ts, "label": f"{kind}, one tensor (torch copy_)",
                         "bytes_ok": bool(torch.equal(bd, bs))}
    del bs, bd
    torch.cuda.empty_cache()
    return out


def cpu_ceilings(specs, reps: int) -> Dict[str, Any]:
    src = [torch.empty(s, dtype=d) for _, s, d in specs]
    dst = [torch.zeros(s, dtype=d) for _, s, d in specs]  # pages touched, as live parameters are
    Pattern(src).fill(src, 1)
    nbytes = sum(t.nbytes for t in src)
    out: Dict[str, Any] = {"bytes": nbytes}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t, ts = median_time(lambda: [d.copy_(s) for d, s in zip(dst, src)], reps)
        out["per_tensor_1thread"] = {"seconds": t, "all": ts, "label": "memcpy, per-tensor loop, 1 thread"}
        bs = torch.cat([s.reshape(-1).view(torch.uint8) for s in src])
        bd = torch.zeros_like(bs)
        t, ts = median_time(lambda: bd.copy_(bs), reps)
        out["one_tensor"] = {"seconds": t, "all": ts, "label": "memcpy, one tensor, 1 thread"}
        torch.set_num_threads(threads)
        t, ts = median_time(lambda: bd.copy_(bs), reps)
        out["one_tensor_all_threads"] = {"seconds": t, "all": ts,
                                         "label": f"memcpy, one tensor, {threads} threads"}
    finally:
        torch.set_num_threads(threads)
    return out
