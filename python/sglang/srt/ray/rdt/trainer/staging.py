"""The trainer's staging pool: CUDA memory the ranks map once and keep mapped.

A rank reads a trainer's GPU tensors through CUDA IPC mappings of their
segments, and must close the mapping of an ordinary segment right after its
copy (CUDA forbids freeing memory another process maps): ~45 us to open and
~30 us to close each segment, 20-30 ms for a model's worth, every update.
The staging pool is a private pool of PyTorch's caching allocator
(``torch.cuda.MemPool``) whose segments stay allocated while the pool lives,
so ranks keep their mappings of it across updates, and tensors made anew
every step land in the same segments again. ``WeightSyncClient`` consumes a
generator passed to ``update()`` inside the pool, allocates its bucket slots
there and offers ``client.staging()``; :func:`release` gives the memory back
once the ranks let go of it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional, Set

import torch

from sglang.srt.ray.rdt.transport import same_node

_lock = threading.Lock()  # guards the per-device pools and their users
_pools: Dict[int, "StagingPool"] = {}  # device index -> this process's pool


class StagingPool:
    """One device's pool and the segment bases it holds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.MemPool()
        self.users = 0  # clients using it (the last one's close releases it)
        self._bases: Set[int] = set()
        self._not_ours: Set[int] = set()  # bases seen outside the pool (until the next refresh)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """New CUDA tensors of this thread on the pool's device come from the pool."""
        with torch.cuda.use_mem_pool(self.pool, self.device):
            yield

    def holds(self, base: int) -> bool:
        """Whether the segment at ``base`` belongs to the pool."""
        if base in self._bases:
            return True
        if base in self._not_ours:
            return False
        self._bases = {int(s["address"]) for s in self.pool.snapshot()}
        self._not_ours.clear()
        if base in self._bases:
            return True
        self._not_ours.add(base)
        return False


def acquire(device) -> StagingPool:
    """This process's pool on CUDA ``device`` (made on first use); pair with
    :func:`release`."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _lock:
        pool = _pools.get(index)
        if pool is None:
            pool = _pools[index] = StagingPool(torch.device("cuda", index))
            same_node.set_keeper(index, pool.holds)
        pool.users += 1
        return pool


def release(pool: Optional[StagingPool]) -> bool:
    """Drop one user of ``pool``; the last one frees its memory (call it only
    once every rank released its mappings of this process). Returns whether
    the pool was freed."""
    if pool is None:
        return False
    with _lock:
        pool.users -= 1
        if pool.users > 0:
            return False
        _pools.pop(pool.device.index, None)
    same_node.set_keeper(pool.device.index, None)  # its segments may be handed out anew
    pool.pool = None  # the allocator frees the pool once nothing references it
    torch.cuda.empty_cache()
    return True
