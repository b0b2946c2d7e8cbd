"""The trainer's staging pool: a ``torch.cuda.MemPool`` whose segments live as long as it does, so ranks map
them once, and tensors made anew each step in ``client.staging()`` land in the same segments again."""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from sglang.srt.ray.rdt.transport import same_node

_lock = threading.Lock()  # guards the per-device pools and their users
_pools: Dict[int, "StagingPool"] = {}  # device index -> this process's pool


class StagingPool:
    """One device's pool, declared to the exporter as kept memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.MemPool()
        self.users = 0  # clients using it (the last one's release frees it)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """New CUDA tensors of this thread on the pool's device come from the pool."""
        with torch.cuda.use_mem_pool(self.pool, self.device):
            yield

    def _snapshot(self) -> List[dict]:
        if self.pool is None:
            return []
        snap = self.pool.snapshot(include_traces=False)
        return [s for s in snap if s.get("device", self.device.index) == self.device.index]

    def segments(self) -> List[Tuple[int, int]]:
        """``(base, size)`` of every segment the pool holds (kept memory)."""
        return [(int(s["address"]), int(s["total_size"])) for s in self._snapshot()]

    def held(self) -> Tuple[int, int]:
        """``(reserved, allocated)`` bytes: what the pool holds, and what of it live tensors use."""
        snap = self._snapshot()
        return (sum(int(s["total_size"]) for s in snap), sum(int(s["allocated_size"]) for s in snap))


def acquire(device) -> StagingPool:
    """This process's pool on CUDA ``device`` (made on first use); pair with :func:`release`."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _lock:
        pool = _pools.get(index)
        if pool is None:
            pool = _pools[index] = StagingPool(torch.device("cuda", index))
            same_node.keep(index, pool.segments)
        pool.users += 1
        return pool


def release(pool: Optional[StagingPool]) -> None:
    """Drop one user of ``pool``; the last one frees it (only once the ranks released their mappings)."""
    if pool is None:
        return
    with _lock:
        pool.users -= 1
        if pool.users > 0:
            return
        _pools.pop(pool.device.index, None)
    same_node.keep(pool.device.index, pool.segments, add=False)  # its segments may be handed out anew
    pool.pool = None  # the allocator frees the pool once nothing references it
    torch.cuda.empty_cache()
