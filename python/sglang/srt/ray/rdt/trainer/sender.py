"""The trainer's two bucket slots: allocated (in the staging pool on a GPU), NIXL-registered once a ref needs it.

No ``ray.put`` snapshots a slot: ranks read its bytes when they pull. So ``fill`` refuses a slot in flight
(:class:`BucketInFlightError`) until ``release``, once every rank's pull of it returned. Slots are freed only
after the ranks dropped their mappings of them (:class:`SenderLink`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError, describe, unwrap
from sglang.srt.ray.rdt.trainer import staging
from sglang.srt.ray.rdt.transport import same_node
from sglang.srt.ray.rdt.transport.cuda_driver import copy_kernel, copy_ptrs, strided_rows

logger = logging.getLogger(__name__)

NUM_SLOTS = 2
# Same-size integer types: a floating tensor's bits copied as they are.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BucketSenderError(RuntimeError):
    """A bucket operation was refused or failed; the message says why."""


class BucketInFlightError(BucketSenderError):
    """A write into a bucket that ranks may still be reading was refused."""


class BucketSender:
    """Double-buffered bucket slots on ``device``, each registered with NIXL before its first ref is put
    (``register=False``: never)."""

    def __init__(self, device: str = "cpu", *, register: bool = True):
        self._device = torch.device(device)
        self._register = register
        self._slots: List[Optional[torch.Tensor]] = [None] * NUM_SLOTS
        self._in_flight: List[Optional[str]] = [None] * NUM_SLOTS
        self._pool = None  # the staging pool the slots live in (CUDA)
        self._closed = False
        self._registered: set = set()  # slots registered with NIXL (the first ref put of each)
        self.stats: Dict[str, int] = {"fills": 0, "allocations": 0, "puts": 0, "registrations": 0}

    @property
    def slot_bytes(self) -> int:
        buf = self._slots[0]
        return 0 if buf is None else buf.numel()

    def _check_open(self) -> None:
        if self._closed:
            raise BucketSenderError("the bucket sender is closed")

    def prepare(self, slot_bytes: int) -> Dict[str, Any]:
        """Slots of at least ``slot_bytes``; re-allocates only to grow (the ranks released the old ones)."""
        self._check_open()
        if slot_bytes > self.slot_bytes:
            if any(self._in_flight):
                raise BucketInFlightError(f"cannot grow the slots while {self._in_flight} are in flight")
            self._free_slots()
            if self._device.type == "cuda" and self._pool is None:
                self._pool = staging.acquire(self._device)
            for i in range(NUM_SLOTS):
                self._slots[i] = self._allocate(slot_bytes)
            self.stats["allocations"] += NUM_SLOTS
        return {"slot_bytes": self.slot_bytes, "slots": NUM_SLOTS}

    def _allocate(self, nbytes: int) -> torch.Tensor:
        with self._pool.allocating() if self._pool is not None else contextlib.nullcontext():
            return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def _register_slot(self, slot: int) -> None:
        """Register ``slot`` with NIXL before its first ref is put (ranks reached by a lane never need it)."""
        if self._register and slot not in self._registered:
            from ray.experimental import register_nixl_memory

            from sglang.srt.ray.rdt.transport.nixl_threads import start_nixl_agent

            start_nixl_agent()  # its progress thread at idle priority
            register_nixl_memory(self._slots[slot])
            self._registered.add(slot)
            self.stats["registrations"] += 1

    def _free_slots(self) -> int:
        n = 0
        for i, buf in enumerate(self._slots):
            if buf is not None:
                if i in self._registered:
                    from ray.experimental import deregister_nixl_memory

                    deregister_nixl_memory(buf)
                    self._registered.discard(i)
                self._slots[i] = None
                n += 1
        return n

    @torch.no_grad()
    def fill(self, slot: int, token: str, offsets: Sequence[Sequence[int]], groups,
             ref_transport: Optional[str], local: bool) -> List[Tuple[Any, Any]]:
        """Gather ``groups`` into ``slot`` at byte ``offsets`` and mark it in flight under ``token``. Returns per
        group ``(ref put with ref_transport or None, same-node description if local or None)``."""
        self._check_open()
        if self._in_flight[slot] is not None:
            raise BucketInFlightError(
                f"slot {slot} is still being read (held by {self._in_flight[slot]!r}); "
                "release it once every rank's pull of it returned")
        buf = self._slots[slot]
        if buf is None:
            raise BucketSenderError("bucket sender not prepared: call prepare() first")
        dst = [buf.data_ptr() + np.asarray(offs, np.int64) for offs in offsets]
        end = max((int(d[-1] - buf.data_ptr() + g.scan.nbytes[-1]) for d, g in zip(dst, groups) if len(d)), default=0)
        if end > buf.numel():
            raise BucketSenderError(f"a step does not fit the slot ({end} > {buf.numel()} bytes); "
                                    "prepare() it larger")
        self._in_flight[slot] = token
        try:
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)  # the trainer's queued work on its tensors
            for d, g in zip(dst, groups):
                gather(buf.device, d, g)
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            if ref_transport:
                self._register_slot(slot)
            out = []
            for offs, d, g in zip(offsets, dst, groups):
                ref = None
                if ref_transport:
                    ref = self._put([self._view(buf, int(o), t) for o, t in zip(offs, g.tensors)], ref_transport)
                out.append((ref, same_node.describe(d, g.scan.nbytes, buf.device) if local else None))
        except BaseException:
            self._in_flight[slot] = None  # no rank was told of it: free for the next fill
            raise
        self.stats["fills"] += 1
        return out

    def _put(self, views, transport: str):
        import ray

        if transport.upper() == "SGLANG_IPC":  # registered in every process that puts
            from sglang.srt.ray.rdt.transport import sglang_ipc

            sglang_ipc.register()
        self.stats["puts"] += 1
        return ray.put(views, _tensor_transport=transport)

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
        """The slot's bytes at ``offset`` as a tensor like ``t``."""
        return buf[offset:offset + t.nbytes].view(t.dtype).view(t.shape)

    def release(self, slot: int, token: str) -> None:
        """Mark ``slot`` free again; ``token`` must be the one it was filled with."""
        self._check_open()
        if self._in_flight[slot] != token:
            held = self._in_flight[slot]
            raise BucketSenderError(f"release of slot {slot} with token {token!r}, but it is "
                                    f"{'free' if held is None else 'held by ' + repr(held)}")
        self._in_flight[slot] = None

    def in_flight(self) -> List[Optional[str]]:
        return list(self._in_flight)

    def close(self) -> int:
        """Free the slots, in flight or not (the ranks released their mappings); returns how many."""
        n = self._free_slots()
        self._closed = True
        staging.release(self._pool)
        self._pool = None
        return n


def gather(device: torch.device, dst: np.ndarray, group) -> None:
    """Copy ``group``'s tensors bit for bit to the addresses ``dst`` on ``device`` (a slot, or a rank's parameters
    mapped here), queued on the current stream: the contiguous ones on a GPU in one kernel, the other views there in
    one strided kernel; any other tensor through a contiguous copy on ``device`` first."""
    sc = group.scan
    here = (sc.device == device.index) & (sc.nbytes > 0) if device.type == "cuda" else np.zeros(len(sc), bool)
    flat = here & sc.contiguous
    if flat.any():
        copy_ptrs(device.index, dst[flat], sc.ptrs[flat], sc.nbytes[flat])
    rows, done = [], flat.copy()
    for i in np.flatnonzero(here & ~sc.contiguous).tolist():
        t = group.tensors[i]
        view = strided_rows(int(dst[i]), int(sc.ptrs[i]), t.shape, t.stride(), t.element_size()) \
            if t.element_size() in _BITS else None
        if view is not None:
            rows += view
            done[i] = True
    if rows:
        copy_kernel(device.index).strided(rows)
    for i in np.flatnonzero(~done & (sc.nbytes > 0)).tolist():
        t = group.tensors[i]
        bits = _BITS.get(t.element_size()) if t.dtype.is_floating_point and t.dim() else None
        tmp = (t.view(bits) if bits is not None else t).to(device).contiguous()  # (NaN payloads kept as they are)
        if device.type == "cuda":
            copy_ptrs(device.index, dst[i:i + 1], np.array([tmp.data_ptr()], np.int64), sc.nbytes[i:i + 1])
        else:
            ctypes.memmove(int(dst[i]), tmp.data_ptr(), int(sc.nbytes[i]))


def write_into(meta, group, device: torch.device) -> None:
    """Write ``group`` into another process's tensors on this GPU that ``meta`` describes (a rank's granted
    parameters), one copy queued on the current stream: wait for it before calling it done. MappingFailed: refused."""
    torch.cuda.synchronize(device)  # the trainer's queued work on its tensors
    with same_node.mapped(meta, device) as dst:
        gather(device, dst, group)


class SenderLink:
    """The client's bucket sender, made on first use; before slots are freed, the ranks drop their mappings."""

    def __init__(self, device: str, call_timeout_s: float):
        self.device, self.call_timeout_s = device, call_timeout_s
        self.sender: Optional[BucketSender] = None
        self.slot_bytes = 0

    def call(self, method: str, *args):
        if self.sender is None:
            self.sender = BucketSender(self.device)
        try:
            return getattr(self.sender, method)(*args)
        except BucketSenderError as e:
            raise WeightSyncError(f"the bucket sender failed in {method}: {describe(e)}") from e

    def prepare(self, slot_bytes: int, ranks) -> None:
        """Slots of at least ``slot_bytes`` before a step is filled."""
        if slot_bytes > self.slot_bytes:
            if self.slot_bytes:
                self.release_rank_mappings(ranks)  # the old slots are about to be freed
            self.slot_bytes = self.call("prepare", slot_bytes)["slot_bytes"]

    def release_rank_mappings(self, ranks) -> None:
        """Every rank closes its kept mappings of the slots (best effort)."""
        if self.sender is not None and self.device.startswith("cuda"):
            release_rank_mappings(ranks, self.call_timeout_s, "the bucket slots")

    def close(self, ranks) -> None:
        """Free the slots, once the ranks let go of them."""
        if self.sender is None:
            return
        try:
            self.release_rank_mappings(ranks)
        finally:
            self.sender.close()
            self.sender = None
            self.slot_bytes = 0


def release_rank_mappings(ranks, timeout_s: float, what: str) -> None:
    """Every rank closes its CUDA IPC mappings of this process's memory (best effort: failures are logged)."""
    import ray

    calls = [(r, r.actor.release_weight_sync_mappings.remote(same_node.token())) for r in ranks]
    for r, ref in calls:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as e:
            logger.warning("[RDT] %s did not release its mappings of %s: %s", r.label(), what, describe(unwrap(e)))
