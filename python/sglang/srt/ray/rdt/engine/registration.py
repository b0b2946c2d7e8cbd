"""Keeping a rank's parameters registered with NIXL, and naming the memory that cannot be.

Memory of PyTorch's ``expandable_segments`` allocator cannot be exported by legacy CUDA IPC, which UCX needs for
a GPU path: it is named before a pull silently crawls over TCP."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.ray.rdt.engine.plan import storage_key, unique_storages

logger = logging.getLogger(__name__)
_EXPANDABLE_CHECKED = False


def expandable_segment_tensors(tensors, snapshot=None) -> List[torch.Tensor]:
    """The CUDA tensors that live in expandable (VMM) segments."""
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda:
        return []
    if snapshot is None:
        snapshot = torch.cuda.memory_snapshot()
    spans = [(seg["address"], seg["address"] + seg["total_size"]) for seg in snapshot if seg.get("is_expandable")]
    if not spans:
        return []
    return [t for t in cuda if any(lo <= t.data_ptr() < hi for lo, hi in spans)]


def warn_if_expandable_segments(tensors) -> None:
    """Warn (once per process) if any CUDA tensor lives in an expandable segment."""
    global _EXPANDABLE_CHECKED
    if _EXPANDABLE_CHECKED:
        return
    if any(t.is_cuda for t in tensors):
        _EXPANDABLE_CHECKED = True  # the allocator snapshot is not free: look once
    try:
        hits = expandable_segment_tensors(tensors)
    except Exception:  # the allocator cannot tell; nothing to warn about
        return
    if hits:
        logger.warning("[RDT] %d of %d tensors live in CUDA expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                       "expandable_segments:True): NIXL/UCX cannot export them over CUDA IPC and silently falls "
                       "back to TCP (~0.3 GB/s). Unset expandable_segments for the rollout engine and the "
                       "trainer's weight buckets.", len(hits), len(tensors))


class RegistrationBook:
    """NIXL registrations of parameter storage, keyed by (device, address, size). A stale one (memory freed,
    reused or grown) would fail a transfer or write someone else's memory: ``sync`` drops it."""

    def __init__(self, register=None, deregister=None):
        if register is None or deregister is None:
            from ray.experimental import deregister_nixl_memory, register_nixl_memory

            register, deregister = register_nixl_memory, deregister_nixl_memory
        self._register, self._deregister = register, deregister
        self._entries: Dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(k[2] for k in self._entries)

    def covers(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._entries

    def sync(self, tensors: Sequence[torch.Tensor]) -> Dict[str, int]:
        """Make the registrations exactly the storages of ``tensors``."""
        current = {storage_key(t): t for t in unique_storages(tensors)}
        dropped = [k for k in self._entries if k not in current]
        for key in dropped:
            self._deregister(self._entries.pop(key))
        added = [k for k in current if k not in self._entries]
        for key in added:
            self._register(current[key])
            self._entries[key] = current[key]
        return {"added": len(added), "dropped": len(dropped)}

    def release_all(self) -> int:
        n = len(self._entries)
        for k, t in list(self._entries.items()):
            try:
                self._deregister(t)
            finally:
                del self._entries[k]
        return n


class ParameterRegistration:
    """Whether and on which storage the parameters stay registered; callers hold the receiver's lock."""

    def __init__(self, get_params, plans, disabled_reason: Optional[str] = None,
                 book: Optional[RegistrationBook] = None):
        self._get_params = get_params
        self._plans = plans
        self.disabled_reason = disabled_reason
        self.book = book
        self.wanted = False
        self._layout = None  # the parameters' (data_ptr, numel) at the last sync

    def __len__(self) -> int:
        return len(self.book or ())

    def register(self) -> Dict[str, int]:
        """Register every parameter's storage (idempotent); what changed."""
        if self.book is None:
            self.book = RegistrationBook()
        walk = self._get_params()
        params = [p.data for p in walk.values()]
        warn_if_expandable_segments(params)
        changes = self.book.sync(params)
        self._layout = _storage_layout(params)
        self._plans.restart(walk)  # (this walk is the next pull's: it plans against it without walking again)
        self.wanted = True
        return changes

    def release(self) -> int:
        """Deregister everything (``wanted`` stays: resume registers again)."""
        self._layout = None
        self._plans.forget()
        if self.book is None:
            return 0
        n = self.book.release_all()
        if n:
            logger.info("[RDT] released %d NIXL registrations", n)
        return n

    def resumed(self) -> None:
        """The weights' memory is back: register it again if it was wanted."""
        self._layout = None
        self._plans.forget()
        if self.wanted and self.book is not None:
            self.book.sync([p.data for p in self._get_params().values()])
            logger.info("[RDT] re-registered %d parameter storages after resume", len(self.book))

    def sync_for_pull(self, targets, walked: bool, reused: bool) -> None:
        """Keep the registrations on current storage: every parameter after a walk, else this pull's targets."""
        if not self.wanted or self.book is None:
            return
        if walked or not (reused or all(self.book.covers(t) for ts in targets for t in ts)):
            self.after_walk()

    def after_walk(self) -> None:
        """Bring the registrations onto every parameter's current storage (after a walk)."""
        if not self.wanted or self.book is None:
            return
        params = self._plans.params if self._plans.params is not None else self._get_params()
        layout = _storage_layout(params.values())
        if layout != self._layout:
            self.book.sync([p.data for p in params.values()])
            self._layout = layout


def _storage_layout(tensors) -> List[Tuple[int, int]]:
    """Each tensor's (data_ptr, numel): what the registrations were last synced to."""
    return [(t.data_ptr(), t.numel()) for t in tensors]
