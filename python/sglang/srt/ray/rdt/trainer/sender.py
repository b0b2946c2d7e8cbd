"""The trainer side of RDT weight sync: reusable, NIXL-registered bucket buffers.

:class:`BucketSender` owns a fixed number of byte buffers ("slots", two for
double buffering). Each is allocated once, registered with NIXL once
(``ray.experimental.register_nixl_memory``) and reused by every update, so a
put costs no allocation, no registration and no handshake with new memory.

A NIXL ``ray.put`` does **not** snapshot: ranks read the slot's bytes when they
pull, possibly long after the put. So a slot has a state:

* ``fill(slot, token, ...)`` copies a bucket into the slot, puts it, and marks
  the slot *in flight* under ``token``;
* ``fill`` on a slot that is in flight raises :class:`BucketInFlightError` —
  the sender itself refuses to overwrite bytes a rank may still be reading;
* ``release(slot, token)`` frees it, and must only be called once every rank's
  pull of that bucket has returned (the client does this).

For the same reason a ref serves again: the ref of a bucket layout put from a
slot is kept, and a later fill of the same layout into that slot returns it
(after waiting for its copies) instead of putting again — every update of one
model fills the same layouts, so only the first update puts.

It runs as a Ray actor declared with ``enable_tensor_transport=True`` (see
:func:`sender_actor_class`); the class itself has no Ray in it except the put,
so it is unit-tested in process. This module imports nothing from sglang and
is shipped to the actor by value: the actor process needs torch and Ray only,
not sglang (whose import costs seconds and a GiB of memory).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

NUM_SLOTS = 2
# Bucket refs a sender keeps for reuse (one per bucket layout and slot).
MAX_KEPT_REFS = 256

# (name, offset, nbytes, shape, dtype name): a tensor's place in a bucket, as
# plain data (``buckets.Slice`` fields) so the actor needs no sglang import.
SliceTuple = Tuple[str, int, int, Tuple[int, ...], str]


class BucketSenderError(RuntimeError):
    """A bucket operation was refused or failed; the message says why."""


class BucketInFlightError(BucketSenderError):
    """A write into a bucket that ranks may still be reading was refused."""


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BucketSenderError(f"unknown dtype {name!r}")
    return dtype


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class BucketSender:
    """Double-buffered, NIXL-registered bucket memory in one process.

    Args:
        device: where the slots live (``"cpu"`` or ``"cuda[:i]"``); put them
            where NIXL reads fastest for the ranks (GPU memory for GPU engines).
        num_slots: buffers kept (2 = fill one while ranks pull the other).
        transport: the RDT transport of the puts: ``"SGLANG_IPC"`` (default:
            the same-node fast path — CUDA IPC for GPU buckets, process_vm_readv
            for CPU ones — whose refs also carry NIXL metadata, so ranks on
            other nodes read them over NIXL) or ``"nixl"``.
        register, deregister, put: injection points for tests; default to
            ``ray.experimental.register_nixl_memory`` / ``deregister_nixl_memory``
            and ``ray.put(tensors, _tensor_transport=transport)``.
    """

    def __init__(
        self,
        device: str = "cpu",
        num_slots: int = NUM_SLOTS,
        *,
        transport: str = "SGLANG_IPC",
        register: Optional[Callable[[torch.Tensor], None]] = None,
        deregister: Optional[Callable[[torch.Tensor], None]] = None,
        put: Optional[Callable[[List[torch.Tensor]], Any]] = None,
    ):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self._device = torch.device(device)
        self._num_slots = num_slots
        self._register, self._deregister, self._put = register, deregister, put
        self.transport = transport.upper()
        if self.transport not in ("NIXL", "SGLANG_IPC"):
            raise ValueError(f"transport must be 'nixl' or 'SGLANG_IPC', got {transport!r}")
        if put is None:  # real puts, in this process, before the first one
            if self.transport == "SGLANG_IPC":
                # (its register() also tames the NIXL progress thread)
                _import_ipc_transport().register()
            else:
                # Before this process's NIXL agent exists: its progress thread
                # must not spin a core for good.
                from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread

                configure_nixl_progress_thread()
        self._slots: List[Optional[torch.Tensor]] = [None] * num_slots
        self._in_flight: List[Optional[str]] = [None] * num_slots
        self._closed = False
        # The ref of each bucket layout put from each slot: a later fill of
        # the same layout writes the same bytes' places, and a ref is read
        # when a rank pulls it (no snapshot at put), so it serves again —
        # no put (1.5-2 ms with a GPU's device sync and Ray's bookkeeping).
        self._refs: Dict[tuple, Any] = {}
        self.stats: Dict[str, Any] = {"fills": 0, "bytes": 0, "allocations": 0, "puts": 0}

    # ------------------------------------------------------------------ #
    def _nixl(self):
        if self._register is None or self._deregister is None:
            from ray.experimental import deregister_nixl_memory, register_nixl_memory

            self._register = self._register or register_nixl_memory
            self._deregister = self._deregister or deregister_nixl_memory
        return self._register, self._deregister

    def _do_put(self, tensors: List[torch.Tensor]):
        if self._put is not None:
            return self._put(tensors)
        import ray

        return ray.put(tensors, _tensor_transport=self.transport)

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise BucketSenderError("the bucket sender is closed")
        if not 0 <= slot < self._num_slots:
            raise ValueError(f"slot {slot} out of range (0..{self._num_slots - 1})")

    @property
    def slot_bytes(self) -> int:
        return min((s.numel() for s in self._slots if s is not None), default=0)

    # ------------------------------------------------------------------ #
    def prepare(self, slot_bytes: int) -> Dict[str, Any]:
        """Make every slot hold at least ``slot_bytes``; register new memory.

        Idempotent and free when the slots are big enough (the usual case:
        every update of one model has the same plan). Growing a slot
        deregisters the old memory first (NIXL keys registrations by address)
        and is refused while any slot is in flight.
        """
        if self._closed:
            raise BucketSenderError("the bucket sender is closed")
        if slot_bytes <= self.slot_bytes and all(s is not None for s in self._slots):
            return self.state()
        busy = [i for i, t in enumerate(self._in_flight) if t is not None]
        if busy:
            raise BucketInFlightError(
                f"cannot resize bucket buffers while slots {busy} are being pulled"
            )
        register, deregister = self._nixl()
        t0 = time.perf_counter()
        self._refs.clear()  # views of the slots about to go
        for i, old in enumerate(self._slots):
            if old is not None:
                self._unmark(old)
                deregister(old)
                self._slots[i] = None
        for i in range(self._num_slots):
            buf = torch.empty(slot_bytes, dtype=torch.uint8, device=self._device)
            register(buf)
            self._mark(buf)
            self._slots[i] = buf
        self.stats["allocations"] += 1
        logger.info(
            "[RDT] bucket sender: %d x %s on %s allocated and NIXL-registered in %.3f s",
            self._num_slots, _mib(slot_bytes), self._device,
            time.perf_counter() - t0,
        )
        return self.state()

    def fill(
        self,
        slot: int,
        token: str,
        regions: Sequence[Tuple[int, Sequence[SliceTuple], Sequence[torch.Tensor]]],
    ) -> List[List[Any]]:
        """Copy one step's buckets into ``slot`` and put each over NIXL.

        Args:
            slot: which buffer to fill.
            token: identifies this use of the slot; ``release`` must repeat it.
            regions: ``(offset, slices, tensors)`` per group: the bucket's place
                in the slot, where each tensor goes (``SliceTuple``: name,
                offset in the bucket, bytes, shape, dtype) and the tensors.

        Returns ``[[ref, ...]]``: one ref per region, nested so that Ray hands
        the refs (not their values) to the caller.

        Raises :class:`BucketInFlightError` if ``slot`` was filled and not yet
        released: ranks may still be reading it.
        """
        self._check_slot(slot)
        if self._in_flight[slot] is not None:
            raise BucketInFlightError(
                f"refusing to overwrite bucket slot {slot}: it is still in flight "
                f"({self._in_flight[slot]}); a rank may be reading it. Release it "
                "only after every rank's pull of it returned."
            )
        buf = self._slots[slot]
        if buf is None:
            raise BucketSenderError("bucket sender not prepared: call prepare() first")
        # Mark first: even a partly written slot must not be handed out again.
        self._in_flight[slot] = token
        refs, nbytes, reused = [], 0, False
        for offset, slices, tensors in regions:
            if len(slices) != len(tensors):
                raise BucketSenderError(f"{len(slices)} slices for {len(tensors)} tensors")
            views = self._views(buf, offset, slices)
            for (name, _, size, shape, dtype), view, t in zip(slices, views, tensors):
                if tuple(t.shape) != tuple(shape) or t.dtype != view.dtype:
                    raise BucketSenderError(
                        f"{name!r}: got shape={list(t.shape)} dtype={t.dtype}, "
                        f"planned shape={list(shape)} dtype={dtype}"
                    )
                view.copy_(t)
                nbytes += size
            ref, put = self._ref(slot, offset, slices, views)
            reused = reused or not put
            refs.append(ref)
        if reused and buf.is_cuda:
            torch.cuda.synchronize(buf.device)  # ranks read as soon as they are asked
        self.stats["fills"] += 1
        self.stats["bytes"] += nbytes
        return [refs]

    def prime(self, slot: int, regions: Sequence[Tuple[int, Sequence[SliceTuple]]]) -> List[List[Any]]:
        """The refs later fills of these bucket layouts into ``slot`` will
        return, put now (``regions``: ``(offset, slices)`` per group; no
        bytes are copied, the slot stays free). A trainer primes its first
        update's buckets at connect, so that update does not put either and
        ranks can prepare their pulls of them (``prepare_pull_weights``)."""
        self._check_slot(slot)
        buf = self._slots[slot]
        if buf is None:
            raise BucketSenderError("bucket sender not prepared: call prepare() first")
        return [[self._ref(slot, offset, slices, self._views(buf, offset, slices))[0]
                 for offset, slices in regions]]

    @staticmethod
    def _views(buf: torch.Tensor, offset: int, slices: Sequence[SliceTuple]) -> List[torch.Tensor]:
        views = []
        for name, rel, size, shape, dtype in slices:
            start = offset + rel
            if start + size > buf.numel():
                raise BucketSenderError(
                    f"{name!r} does not fit the bucket buffer "
                    f"({start + size} > {buf.numel()} bytes); prepare() it larger"
                )
            views.append(buf[start : start + size].view(_torch_dtype(dtype)).view(tuple(shape)))
        return views

    def _ref(self, slot: int, offset: int, slices: Sequence[SliceTuple], views) -> Tuple[Any, bool]:
        """The kept ref of this layout in ``slot`` (and False), or a new one put
        now (and True)."""
        key = (slot, offset, tuple((rel, size, tuple(shape), str(dtype))
                                   for _, rel, size, shape, dtype in slices))
        ref = self._refs.get(key)
        if ref is not None:
            return ref, False
        if len(self._refs) >= MAX_KEPT_REFS:
            self._refs.clear()
        ref = self._refs[key] = self._do_put(views)  # a put waits for the copies
        self.stats["puts"] += 1
        return ref, True

    def release(self, slot: int, token: str) -> None:
        """Mark ``slot`` free again; ``token`` must be the one it was filled with."""
        self._check_slot(slot)
        if self._in_flight[slot] != token:
            raise BucketSenderError(
                f"release of slot {slot} with token {token!r}, but it is "
                f"{'free' if self._in_flight[slot] is None else 'held by ' + repr(self._in_flight[slot])}"
            )
        self._in_flight[slot] = None

    def in_flight(self) -> List[Optional[str]]:
        return list(self._in_flight)

    def state(self) -> Dict[str, Any]:
        return {
            "device": str(self._device),
            "slots": self._num_slots,
            "slot_bytes": self.slot_bytes,
            "in_flight": list(self._in_flight),
            "closed": self._closed,
            **self.stats,
        }

    def close(self) -> int:
        """Deregister and free the slots (in flight or not); returns how many."""
        n = 0
        self._refs.clear()
        if any(s is not None for s in self._slots):
            _, deregister = self._nixl()
            for i, buf in enumerate(self._slots):
                if buf is not None:
                    self._unmark(buf)
                    deregister(buf)
                    self._slots[i] = None
                    n += 1
        self._closed = True
        return n

    # Same-node GPU path: the slots outlive every update, so ranks may keep
    # their CUDA IPC mappings of them between updates (re-opening a 1 GiB
    # mapping costs ~10 ms); the client makes the ranks release them before
    # the slots are freed or grown (WeightSyncClient.close / prepare).
    def _ipc(self):
        if self.transport != "SGLANG_IPC" or self._put is not None or self._device.type != "cuda":
            return None
        return _import_ipc_transport()

    def _mark(self, buf: torch.Tensor) -> None:
        ipc = self._ipc()
        if ipc is not None and not ipc.mark_persistent(buf):
            logger.info("[RDT] bucket slot is not a whole CUDA segment; ranks re-map it every update")

    def _unmark(self, buf: torch.Tensor) -> None:
        ipc = self._ipc()
        if ipc is not None:
            ipc.unmark_persistent(buf)

    def ipc_sender_token(self) -> Optional[str]:
        """The identity ranks key their mappings of these slots by (None when
        the slots are not shared over CUDA IPC)."""
        ipc = self._ipc()
        return ipc.sender_token() if ipc is not None else None


def _import_ipc_transport():
    from sglang.srt.ray.rdt.transport import sglang_ipc

    return sglang_ipc


_ACTOR_CLASS = None


def sender_actor_class():
    """``BucketSender`` as a Ray actor class that can put over NIXL.

    The class travels to the actor by value (this module is registered with
    Ray's cloudpickle), so the actor does not import sglang.
    """
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import sys

        import ray
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        _ACTOR_CLASS = ray.remote(enable_tensor_transport=True)(BucketSender)
    return _ACTOR_CLASS
