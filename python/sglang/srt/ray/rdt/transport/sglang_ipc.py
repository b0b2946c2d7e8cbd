"""Same-node fast path for RDT weight sync: CUDA IPC + copy engine (GPU) or
cross-memory attach (CPU), NIXL otherwise.

A custom Ray Direct Transport (``ray.experimental.register_tensor_transport``)
named ``SGLANG_IPC``. A sender puts its tensors with
``ray.put(tensors, _tensor_transport="SGLANG_IPC")``; the metadata of that ref
carries two ways to read them:

* GPU tensors: CUDA IPC handles of the cudaMalloc segments that hold the
  tensors (plus each tensor's offset in its segment), the sender's node id and
  GPU UUID; CPU tensors: the sender's pid, its process start time and each
  tensor's address (read with ``process_vm_readv``, :mod:`.cma`);
* the ordinary NIXL metadata of the same tensors (the sender's NIXL
  registrations are reused, so ``register_nixl_memory`` still pays off).

CPU receivers on the sender's host read with a few threads
(``SGLANG_RDT_CMA_THREADS``, default min(4, cores)); a read the kernel refuses
(no ptrace rights: non-root containers, Yama) is detected with a one-byte probe
before anything is written and goes through NIXL instead
(``SGLANG_RDT_CMA=0`` turns the CPU path off).

The receiver (``ray.get`` after ``set_target_for_ref``) picks automatically: a
receiver on the sender's node that sees the sender's GPU maps the segments and
copies with the copy engine straight into the target buffers; anything else —
another node, a GPU it cannot see, CPU tensors, memory that cannot be exported
by legacy CUDA IPC (``expandable_segments``), a failed ``cuIpcOpenMemHandle`` —
reads through NIXL as before. :func:`fetch_info` says which path the fetch of
a ref took and why (:func:`last_fetch`: the latest fetch in this process).

Where each part lives: :mod:`.cuda_ipc` (GPU tensors: export, map, copy),
:mod:`.mapping_cache` (what a receiver keeps mapped, and when it closes it),
:mod:`.cma` (CPU tensors), :mod:`.persistent` (sender buffers kept across
updates), :mod:`.metadata` (what a ref carries), :mod:`.compat` (Ray's and
NIXL's private parts). This module is the Ray-facing manager and the
per-process registration.

Ray pushes a custom transport to a new actor asynchronously, so every process
that puts or gets calls :func:`register` itself (idempotent); the creator must
also call it before it creates the actors.

Tuning: ``SGLANG_RDT_IPC_NIXL_FALLBACK`` (``1``: also put NIXL metadata,
default; ``0``: a ref is readable only over same-node IPC); the CUDA IPC path's
own settings are in :mod:`.cuda_ipc`. Measured: docs/performance.md.
:func:`put_options` sets both for the puts of one block of code (a sender that
knows every receiver is on its node and sees its GPU puts without NIXL
metadata: no NIXL registration of what it puts, a smaller ref);
:func:`reach` is what a receiver tells senders about itself for that.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

from sglang.srt.ray.rdt.transport import compat
from sglang.srt.ray.rdt.transport.cma import CmaPath
from sglang.srt.ray.rdt.transport.cuda_driver import CudaDriverError
from sglang.srt.ray.rdt.transport.cuda_ipc import CudaIpcPath
from sglang.srt.ray.rdt.transport.metadata import (
    FetchInfo,
    IpcCommunicatorMetadata,
    MappingFailed,
    SglangIpcTransportMetadata,
)
from sglang.srt.ray.rdt.transport.persistent import mark_persistent, unmark_persistent

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "SGLANG_IPC"
__all__ = [
    "TRANSPORT_NAME", "SglangIpcTransport", "register", "transport", "fetch_info", "put_options", "reach",
    "last_fetch", "close_ipc_mappings", "release_sender_mappings", "sender_token",
    "mark_persistent", "unmark_persistent",
]

_TransportManager = compat.transport_base_classes()[1]

# Per-thread options of the puts made inside put_options() (Ray calls
# extract_tensor_transport_metadata synchronously in the thread that puts).
_put_options = threading.local()


@contextlib.contextmanager
def put_options(*, nixl: Optional[bool] = None, persistent: Optional[bool] = None) -> Iterator[None]:
    """Options for the ``SGLANG_IPC`` puts of this thread inside the block.

    ``nixl=False``: the refs carry no NIXL metadata (the tensors are not
    registered with NIXL; a receiver that cannot read them over same-node IPC
    fails the read before any byte moves). ``persistent=True``: declare the
    GPU segments of the tensors kept across updates (receivers keep their
    mappings when an update ends; the owner makes them release the mappings
    with ``release_weight_sync_mappings`` before it frees them, and a mapping
    unused for a whole update is closed at its end anyway).
    """
    old = getattr(_put_options, "value", None)
    _put_options.value = {"nixl": nixl, "persistent": persistent}
    try:
        yield
    finally:
        _put_options.value = old


def _put_option(name: str):
    value = getattr(_put_options, "value", None)
    return None if value is None else value.get(name)


_reach: Optional[Dict[str, Any]] = None


def reach() -> Dict[str, Any]:
    """Where this process can read ``SGLANG_IPC`` refs over CUDA IPC from: its
    Ray node and the UUIDs of the GPUs it sees (a sender on that node whose
    GPU is listed needs no NIXL metadata for it)."""
    global _reach
    if _reach is None:
        import ray
        import torch

        from sglang.srt.ray.rdt.transport.cuda_driver import device_uuid

        gpus = []
        if torch.cuda.is_available():
            gpus = [device_uuid(i) for i in range(torch.cuda.device_count())]
        _reach = {"node_id": ray.get_runtime_context().get_node_id(), "gpus": gpus}
    return dict(_reach)


class SglangIpcTransport(_TransportManager):  # type: ignore[misc,valid-type]
    """Ray's manager of ``SGLANG_IPC`` in one process: picks the path of each fetch."""

    def __init__(self):
        self.token = uuid.uuid4().hex  # this process's sender identity
        self.cuda_ipc = CudaIpcPath(self.token)
        self.cma = CmaPath(self.token)
        from sglang.srt.environ import envs

        self.nixl_fallback = envs.SGLANG_RDT_IPC_NIXL_FALLBACK.get()
        self.last: Optional[FetchInfo] = None
        self.recent: "OrderedDict[str, FetchInfo]" = OrderedDict()  # by object id
        self.counts = {"cuda_ipc": 0, "cma": 0, "nixl": 0}
        self._warned: set = set()
        self._node_id: Optional[str] = None
        self._lock = threading.Lock()

    def node_id(self) -> str:
        if self._node_id is None:
            import ray

            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    # -- Ray's interface ---------------------------------------------------- #
    def tensor_transport_backend(self) -> str:
        return TRANSPORT_NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor) -> bool:
        return True

    @staticmethod
    def _nixl():
        return compat.transport_manager("NIXL")

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return IpcCommunicatorMetadata()

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[Any]):
        import torch

        tensor_meta = [(t.shape, t.dtype) for t in rdt_object]
        device = rdt_object[0].device if rdt_object else None
        meta = SglangIpcTransportMetadata(
            tensor_meta=tensor_meta, tensor_device=device.type if device else None
        )
        if not rdt_object:
            return meta
        if any(t.device.type != device.type for t in rdt_object):
            raise ValueError("All tensors in an RDT object must be on one device type.")
        if any(not t.is_contiguous() for t in rdt_object):
            raise ValueError("All tensors in an RDT object must be contiguous.")
        nixl_fallback = _put_option("nixl")
        nixl_fallback = self.nixl_fallback if nixl_fallback is None else nixl_fallback
        if device.type == "cpu":
            meta.ipc_unavailable = "tensors on cpu"
            if nixl_fallback:
                meta.nixl = self._nixl().extract_tensor_transport_metadata(obj_id, rdt_object)
            meta.cma = self.cma.export(rdt_object, self.node_id())
            if meta.cma is None and meta.nixl is None:
                raise ValueError("/proc is not readable here and NIXL fall-back is off")
            return meta
        if nixl_fallback or device.type != "cuda":
            # Synchronises the devices before registering, like a NIXL put.
            meta.nixl = self._nixl().extract_tensor_transport_metadata(obj_id, rdt_object)
        if device.type != "cuda":
            meta.ipc_unavailable = f"tensors on {device.type}"
            return meta
        if any(t.device != device for t in rdt_object):
            meta.ipc_unavailable = "tensors on several devices"
            return meta
        if meta.nixl is None:
            torch.cuda.synchronize(device)
        try:
            meta.ipc = self.cuda_ipc.export(rdt_object, device.index, self.node_id(),
                                            persistent=bool(_put_option("persistent")))
        except CudaDriverError as e:
            # e.g. expandable_segments (VMM) memory: legacy IPC cannot export it.
            meta.ipc_unavailable = f"CUDA IPC export failed: {e}"
            if meta.nixl is None:
                raise
        return meta

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata,
                              target_buffers=None):
        meta = tensor_transport_metadata
        assert isinstance(meta, SglangIpcTransportMetadata), type(meta)
        if not meta.tensor_meta:
            return []
        t0 = time.perf_counter()
        # CPU tensors: process_vm_readv; GPU tensors: CUDA IPC; else NIXL.
        path = self.cma if meta.cma is not None else self.cuda_ipc
        name = "cma" if meta.cma is not None else "cuda_ipc"
        why = path.unusable(meta, target_buffers, self.node_id())
        if why is None:
            try:
                info = FetchInfo(obj_id=obj_id, path=name)
                out = path.receive(meta, target_buffers, info)
                info.seconds = time.perf_counter() - t0
                self._done(info)
                return out
            except MappingFailed as e:
                # Refused before any byte moved: NIXL can still serve this fetch.
                why = str(e)
                if name == "cuda_ipc" and meta.nixl is None:
                    raise RuntimeError(
                        f"CUDA IPC fetch failed and the ref has no NIXL metadata: {why}"
                    ) from e
        if meta.nixl is None:
            raise ValueError(
                f"this {TRANSPORT_NAME} ref can only be read over same-node IPC, which is "
                f"not possible here ({why}); put it with SGLANG_RDT_IPC_NIXL_FALLBACK=1"
            )
        if why not in self._warned:
            self._warned.add(why)
            logger.info("[RDT] %s: reading through NIXL (%s)", TRANSPORT_NAME, why)
        out = self._nixl().recv_multiple_tensors(
            obj_id, meta.nixl, compat.nixl_communicator_metadata(), target_buffers
        )
        info = FetchInfo(
            obj_id=obj_id, path="nixl", reason=why, tensors=len(meta.tensor_meta),
            bytes=sum(t.numel() * t.element_size() for t in out),
            seconds=time.perf_counter() - t0,
        )
        self._done(info)
        return out

    def fetch_same_node(self, obj_id: str, meta, targets, copy: bool = True,
                        while_copying=None) -> Optional[List[Any]]:
        """Read a ref straight into ``targets`` when the same-node path (CUDA
        IPC or process_vm_readv) serves it here, without Ray's fetch around it
        (``ray.get`` costs ~0.5-1 ms per call: the placeholder's round trip to
        its owner and the fetch bookkeeping). Returns the targets, or None
        when this process cannot read the ref that way (nothing was written;
        the caller then uses ``ray.get``, which takes the NIXL fall-back).
        Raises on a read that broke after it started. ``copy=False``: only
        open what the read needs (CUDA IPC mappings, copy plan; a check of
        process_vm_readv rights) and write nothing. ``while_copying(written)``:
        run once the read is under way (CUDA IPC: while the copy engine works,
        ``written`` True; CPU: just before the reads, False), only if this path
        serves the ref."""
        if not isinstance(meta, SglangIpcTransportMetadata) or not meta.tensor_meta or not targets:
            return None
        path = self.cma if meta.cma is not None else self.cuda_ipc
        name = "cma" if meta.cma is not None else "cuda_ipc"
        if path.unusable(meta, targets, self.node_id()) is not None:
            return None
        t0 = time.perf_counter()
        info = FetchInfo(obj_id=obj_id, path=name)
        try:
            out = path.receive(meta, targets, info, copy=copy, while_copying=while_copying)
        except MappingFailed:
            return None  # refused before any byte moved
        info.seconds = time.perf_counter() - t0
        if copy:
            self._done(info)
        return out

    def nixl_part(self, meta, targets) -> Optional[Tuple[Any, str]]:
        """``(NIXL metadata, why)`` of a ref this process reads through NIXL
        because the same-node path does not serve it here (after
        :meth:`fetch_same_node` returned None), so that the caller can read
        it without Ray's fetch (:mod:`.nixl_reader`). None when the ref has
        no NIXL metadata (``ray.get`` then says why it cannot be read)."""
        if not isinstance(meta, SglangIpcTransportMetadata) or meta.nixl is None or not meta.tensor_meta:
            return None
        path = self.cma if meta.cma is not None else self.cuda_ipc
        why = path.unusable(meta, targets, self.node_id()) or "the same-node read was refused"
        if why not in self._warned:
            self._warned.add(why)
            logger.info("[RDT] %s: reading through NIXL (%s)", TRANSPORT_NAME, why)
        return meta.nixl, why

    def note_nixl_read(self, obj_id: str, why: str, targets, seconds: float) -> None:
        """Record a read of a ref's NIXL part made by the caller (:meth:`nixl_part`)."""
        self._done(FetchInfo(obj_id=obj_id, path="nixl", reason=why, tensors=len(targets),
                             bytes=sum(t.nbytes for t in targets), seconds=seconds))

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError(f"{TRANSPORT_NAME} is one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        if getattr(tensor_transport_meta, "nixl", None) is not None:
            self._nixl().garbage_collect(obj_id, tensor_transport_meta.nixl, tensors)

    def abort_transport(self, obj_id, communicator_metadata):
        # An IPC copy is short and synchronous; only a NIXL read can be in flight.
        self._nixl().abort_transport(obj_id, compat.nixl_communicator_metadata())

    # -- bookkeeping ------------------------------------------------------- #
    def _done(self, info: FetchInfo) -> None:
        with self._lock:
            self.last = info
            self.recent[info.obj_id] = info
            while len(self.recent) > 256:
                self.recent.popitem(last=False)
            self.counts[info.path] = self.counts.get(info.path, 0) + 1

    def mapping_stats(self) -> Dict[str, Any]:
        return {**self.cuda_ipc.cache.stats(), "fetches": dict(self.counts)}


# --------------------------------------------------------------------------- #
# Registration and helpers
# --------------------------------------------------------------------------- #
_register_lock = threading.Lock()
_registered = False  # in this process, by register()


def register() -> str:
    """Register the transport in this process (idempotent). Returns its name.

    Call it in the process that creates the actors, before creating them, and
    in every actor that puts or gets with it (Ray's own push to a new actor is
    asynchronous and can lose the race against the actor's first call).
    """
    import torch

    from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread

    global _registered
    if _registered and compat.transport_registered(TRANSPORT_NAME):  # hot path: every lookup
        return TRANSPORT_NAME
    # SGLANG_IPC refs carry NIXL metadata, so this process gets a NIXL agent:
    # keep its progress thread from spinning a core (see nixl_progress).
    configure_nixl_progress_thread()
    with _register_lock:
        compat.register_transport(TRANSPORT_NAME, ["cuda", "cpu"], SglangIpcTransport, torch.Tensor)
        _registered = True
    return TRANSPORT_NAME


def transport() -> SglangIpcTransport:
    register()
    return compat.transport_manager(TRANSPORT_NAME)


def last_fetch() -> Optional[FetchInfo]:
    """What the last fetch in this process did (path, reason, timings)."""
    return transport().last


def fetch_info(ref) -> Optional[FetchInfo]:
    """What the fetch of ``ref`` (an ObjectRef or its hex id) did in this process."""
    key = ref if isinstance(ref, str) else ref.hex()
    return transport().recent.get(key)


def close_ipc_mappings(keep_persistent: bool = False) -> int:
    """Close the cached CUDA IPC mappings of this process (all of them, or all
    but those of persistent sender buffers)."""
    if not compat.transport_in_use(TRANSPORT_NAME):
        return 0
    return transport().cuda_ipc.cache.close_all(keep_persistent=keep_persistent)


def release_sender_mappings(sender: Optional[str] = None) -> int:
    """Close this process's mappings of ``sender``'s memory (every sender: None)."""
    if not compat.transport_in_use(TRANSPORT_NAME):
        return 0
    return transport().cuda_ipc.cache.release_sender(sender)


def sender_token() -> str:
    """This process's sender identity in the refs it puts (receivers key their
    mappings by it)."""
    return transport().token
