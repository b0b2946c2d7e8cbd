"""The trainer's bucket slots: reusable buffers the ranks read copies from.

When the ranks cannot read the trainer's own tensors (another node, a
``nixl`` transport, host memory without ``export="direct"``), each group of
an update is copied into one of two slots and read from there while the next
group is copied into the other. :class:`BucketSender` owns the slots in the
trainer's process: allocated once (in the staging pool on a GPU), registered
with NIXL once, refilled by every update.

No ``ray.put`` snapshots a slot: ranks read its bytes when they pull. So
``fill`` marks a slot in flight under a token and refuses to overwrite a slot
in flight (:class:`BucketInFlightError`); ``release`` frees it once every
rank's pull of it returned.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.ray.rdt.errors import WeightSyncError, describe, unwrap
from sglang.srt.ray.rdt.trainer import staging
from sglang.srt.ray.rdt.transport import same_node
from sglang.srt.ray.rdt.transport.cuda_driver import copy_tensors

logger = logging.getLogger(__name__)

NUM_SLOTS = 2


class BucketSenderError(RuntimeError):
    """A bucket operation was refused or failed; the message says why."""


class BucketInFlightError(BucketSenderError):
    """A write into a bucket that ranks may still be reading was refused."""


class BucketSender:
    """Double-buffered, NIXL-registered bucket slots in one process on
    ``device``; ``register=False``: without NIXL."""

    def __init__(self, device: str = "cpu", *, register: bool = True):
        self._device = torch.device(device)
        self._register = register
        self._slots: List[Optional[torch.Tensor]] = [None] * NUM_SLOTS
        self._in_flight: List[Optional[str]] = [None] * NUM_SLOTS
        self._pool = None  # the staging pool the slots live in (CUDA)
        self._closed = False
        self.stats: Dict[str, int] = {"fills": 0, "allocations": 0, "puts": 0}

    @property
    def slot_bytes(self) -> int:
        buf = self._slots[0]
        return 0 if buf is None else buf.numel()

    def _check_open(self) -> None:
        if self._closed:
            raise BucketSenderError("the bucket sender is closed")

    def prepare(self, slot_bytes: int) -> Dict[str, Any]:
        """Slots of at least ``slot_bytes``; re-allocates only to grow (the
        caller made the ranks release their mappings of the old slots first)."""
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
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        if self._register:
            from ray.experimental import register_nixl_memory

            from sglang.srt.ray.rdt.transport.nixl_threads import start_nixl_agent

            start_nixl_agent()  # its progress thread at idle priority
            register_nixl_memory(buf)
        return buf

    def _free_slots(self) -> int:
        n = 0
        for i, buf in enumerate(self._slots):
            if buf is not None:
                if self._register:
                    from ray.experimental import deregister_nixl_memory

                    deregister_nixl_memory(buf)
                self._slots[i] = None
                n += 1
        return n

    @torch.no_grad()
    def fill(self, slot: int, token: str, offsets: Sequence[Sequence[int]],
             tensors: Sequence[Sequence[torch.Tensor]], ref_transport: Optional[str],
             local: bool) -> List[Tuple[Any, Any]]:
        """Copy each region's ``tensors`` into ``slot`` at ``offsets`` (bytes),
        mark the slot in flight under ``token``. Returns per region ``(ref,
        description)``: a ref put with ``ref_transport`` (if given) and a
        same-node description for the lanes (if ``local``)."""
        self._check_open()
        if self._in_flight[slot] is not None:
            raise BucketInFlightError(
                f"slot {slot} is still being read (held by {self._in_flight[slot]!r}); "
                "release it once every rank's pull of it returned")
        buf = self._slots[slot]
        if buf is None:
            raise BucketSenderError("bucket sender not prepared: call prepare() first")
        self._in_flight[slot] = token  # from here on: a failed fill leaves it reserved
        views = [[self._view(buf, off, t) for off, t in zip(offs, ts)]
                 for offs, ts in zip(offsets, tensors)]
        flat_views = [v for vs in views for v in vs]
        flat_tensors = [t for ts in tensors for t in ts]
        if buf.is_cuda:  # bit for bit (torch._foreach_copy_ rewrites NaN payloads)
            torch.cuda.synchronize(buf.device)  # the trainer's queued work on its tensors
            # the kernel reads sources on the slots' GPU; others (host memory,
            # another GPU) are copied by torch
            here = [i for i, t in enumerate(flat_tensors) if t.device == buf.device]
            copy_tensors([flat_views[i] for i in here], [flat_tensors[i].contiguous() for i in here])
            if len(here) < len(flat_tensors):
                for i in sorted(set(range(len(flat_tensors))) - set(here)):
                    flat_views[i].copy_(flat_tensors[i])
                torch.cuda.synchronize(buf.device)
        else:
            for v, t in zip(flat_views, flat_tensors):
                v.copy_(t)
        out = []
        for vs in views:
            ref = self._put(vs, ref_transport) if ref_transport else None
            out.append((ref, same_node.export(vs) if local else None))
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
        n = t.nbytes
        if offset + n > buf.numel():
            raise BucketSenderError(f"a tensor does not fit the slot ({offset + n} > "
                                    f"{buf.numel()} bytes); prepare() it larger")
        return buf[offset:offset + n].view(t.dtype).view(t.shape)

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
        """Free the slots (in flight or not; the caller made the ranks release
        their mappings first); returns how many."""
        n = self._free_slots()
        self._closed = True
        if self._pool is not None:
            staging.release(self._pool)
            self._pool = None
        return n


class SenderLink:
    """The client's bucket sender (made on first use, grown when an update
    needs bigger slots, closed with the client): before slots are freed,
    every rank is asked to let go of its mappings of them."""

    def __init__(self, device: str, call_timeout_s: float):
        self.device = device
        self.call_timeout_s = call_timeout_s
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
            release_rank_mappings(ranks, same_node.token(), self.call_timeout_s, "the bucket slots")

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


def release_rank_mappings(ranks, token: str, timeout_s: float, what: str) -> None:
    """Every rank closes its kept CUDA IPC mappings of sender ``token``'s
    memory before it is freed (best effort per rank: a failure is logged)."""
    import ray

    calls = [(r, r.actor.release_weight_sync_mappings.remote(token)) for r in ranks]
    for r, ref in calls:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as e:
            logger.warning("[RDT] %s did not release its mappings of %s: %s",
                           r.label(), what, describe(unwrap(e)))
