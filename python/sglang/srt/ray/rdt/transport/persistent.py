"""Sender side: CUDA buffers kept across updates (``WeightSyncClient``'s buckets).

Refs whose segments are all declared here say so (``IpcPart.persistent``),
and receivers keep those mappings when an update ends (re-opening a 1 GiB
mapping costs 10-13 ms on H200s). The owner must make every receiver release
them (``release_weight_sync_mappings`` on the ranks) before it frees or
re-allocates such a buffer.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, Tuple

from sglang.srt.ray.rdt.transport.cuda_driver import driver

# (device ordinal, segment base) -> segment size
_persistent: Dict[Tuple[int, int], int] = {}
_lock = threading.Lock()


def mark_persistent(t) -> bool:
    """Declare ``t``'s CUDA segment persistent (it must be one whole cudaMalloc
    segment, e.g. a large ``torch.empty``). Returns False when it is not."""
    if not getattr(t, "is_cuda", False):
        return False
    drv = driver()
    ordinal = t.device.index
    drv.push(ordinal)
    try:
        base, size = drv.address_range(t.data_ptr())
    finally:
        drv.pop()
    if base != t.data_ptr() or size < t.numel() * t.element_size():
        return False
    with _lock:
        _persistent[(ordinal, base)] = size
    return True


def unmark_persistent(t) -> None:
    if not getattr(t, "is_cuda", False):
        return
    with _lock:
        _persistent.pop((t.device.index, t.data_ptr()), None)


def all_persistent(ordinal: int, segments: Iterable[Tuple[int, int, bytes]]) -> bool:
    """Whether every ``(base, size, handle)`` segment was declared persistent."""
    segments = list(segments)
    with _lock:
        return bool(segments) and all(
            _persistent.get((ordinal, base)) == size for base, size, _ in segments
        )
