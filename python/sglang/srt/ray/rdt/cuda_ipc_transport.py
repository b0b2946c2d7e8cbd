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

Life cycle of the mapped segments (a stale mapping must never be read):

* the sender never caches handles: every put asks the driver for the handle of
  the segment as it is now (a re-allocated segment has a new handle, even at
  the same address);
* the receiver caches opened mappings by (sender process, segment base) and
  uses one only when the current ref names the same handle and size; a
  different handle at that base closes the old mapping first;
* the ref keeps the sender's tensors alive during the fetch, and every copy is
  finished (host-side stream sync) before the fetch returns, so nothing reads
  a mapping after the ref is gone;
* mappings unused for ``max_idle_fetches`` fetches, and all mappings of the
  oldest sender once more than ``max_senders`` were seen, are closed;
  :func:`close_ipc_mappings` closes everything. An open mapping may keep a
  segment the sender has since freed from going back to its GPU (legacy CUDA
  IPC; not measured here), so a receiver should close its mappings when an
  update session ends if the trainer re-allocates what it puts; re-opening
  costs about one cold pull (docs/performance.md).

Traps this avoids (../DESIGN.md section 3): no inter-process CUDA event is
waited on from another GPU's stream (that segfaulted): the sender synchronises
its device when it creates the ref, as Ray's NIXL transport does, and the
receiver synchronises its copy streams on the host. Ray pushes a custom
transport to a new actor asynchronously, so every process that puts or gets
calls :func:`register` itself (idempotent); the creator must also call it
before it creates the actors.

Tuning (environment, read when the transport is created in a process):
``SGLANG_RDT_IPC_METHOD`` (``batch``: one ``cuMemcpyBatchAsync`` for all
tensors, default, falls back to ``ce`` if the driver refuses; ``ce``: one
``cuMemcpyAsync`` per tensor; ``kernel``: one SM copy kernel, experimental,
needs CuPy), ``SGLANG_RDT_IPC_STREAMS`` (copy streams, default 1),
``SGLANG_RDT_IPC_ENGINE`` (``dst``: the receiving GPU reads over NVLink,
default; ``src``: the source GPU writes, which costs a CUDA context on the
source GPU in the receiving process), ``SGLANG_RDT_IPC_NIXL_FALLBACK`` (``1``:
also put NIXL metadata, default). Measured on two H200s (NVLink):
docs/performance.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "SGLANG_IPC"

# --------------------------------------------------------------------------- #
# CUDA driver API through ctypes (no extra dependency; loaded on first use)
# --------------------------------------------------------------------------- #
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CUDA_ERROR_ALREADY_MAPPED = 208


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


class _CUipcMemHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as bytes cut at the
    # first NUL (and writing through that copy corrupts memory).
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
    """The few CUDA driver calls this module needs."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, sz, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p

        def fn(names, argtypes):
            for n in names:
                f = getattr(lib, n, None)
                if f is not None:
                    f.restype = ctypes.c_int
                    f.argtypes = argtypes
                    return f
            raise AttributeError(f"libcuda has none of {names}")

        self.cuInit = fn(["cuInit"], [ctypes.c_uint])
        self.cuGetErrorName = fn(["cuGetErrorName"], [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self.cuDeviceGet = fn(["cuDeviceGet"], [ctypes.POINTER(ctypes.c_int), ctypes.c_int])
        self.cuDevicePrimaryCtxRetain = fn(
            ["cuDevicePrimaryCtxRetain"], [ctypes.POINTER(p), ctypes.c_int]
        )
        self.cuCtxPushCurrent = fn(["cuCtxPushCurrent_v2", "cuCtxPushCurrent"], [p])
        self.cuCtxPopCurrent = fn(["cuCtxPopCurrent_v2", "cuCtxPopCurrent"], [ctypes.POINTER(p)])
        self.cuCtxEnablePeerAccess = fn(["cuCtxEnablePeerAccess"], [p, ctypes.c_uint])
        self.cuMemGetAddressRange = fn(
            ["cuMemGetAddressRange_v2", "cuMemGetAddressRange"],
            [ctypes.POINTER(u64), ctypes.POINTER(sz), u64],
        )
        self.cuIpcGetMemHandle = fn(["cuIpcGetMemHandle"], [ctypes.POINTER(_CUipcMemHandle), u64])
        self.cuIpcOpenMemHandle = fn(
            ["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"],
            [ctypes.POINTER(u64), _CUipcMemHandle, ctypes.c_uint],
        )
        self.cuIpcCloseMemHandle = fn(["cuIpcCloseMemHandle"], [u64])
        self.cuMemcpyDtoDAsync = fn(
            ["cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"], [u64, u64, sz, p]
        )
        # CUDA 12.8+: one call for a list of copies (13.x: _v2, without failIdx).
        self._batch_v2 = True
        try:
            self.cuMemcpyBatchAsync = fn(
                ["cuMemcpyBatchAsync_v2"], [p, p, p, sz, p, p, sz, p]
            )
        except AttributeError:
            self._batch_v2 = False
            try:
                self.cuMemcpyBatchAsync = fn(["cuMemcpyBatchAsync"], [p, p, p, sz, p, p, sz, p, p])
            except AttributeError:
                self.cuMemcpyBatchAsync = None
        self.check("cuInit", self.cuInit(0))
        self._ctx: Dict[int, int] = {}

    def check(self, call: str, rc: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cuGetErrorName(rc, ctypes.byref(name))
            raise CudaDriverError(call, rc, (name.value or b"?").decode())

    def primary_ctx(self, ordinal: int) -> int:
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            dev = ctypes.c_int()
            self.check("cuDeviceGet", self.cuDeviceGet(ctypes.byref(dev), ordinal))
            c = ctypes.c_void_p()
            self.check("cuDevicePrimaryCtxRetain", self.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
            ctx = self._ctx[ordinal] = c.value
        return ctx

    def push(self, ordinal: int) -> None:
        self.check("cuCtxPushCurrent", self.cuCtxPushCurrent(ctypes.c_void_p(self.primary_ctx(ordinal))))

    def pop(self) -> None:
        c = ctypes.c_void_p()
        self.check("cuCtxPopCurrent", self.cuCtxPopCurrent(ctypes.byref(c)))

    def enable_peer_access(self, from_ordinal: int, to_ordinal: int) -> None:
        """Let ``from_ordinal``'s context access ``to_ordinal``'s memory."""
        self.push(from_ordinal)
        try:
            rc = self.cuCtxEnablePeerAccess(ctypes.c_void_p(self.primary_ctx(to_ordinal)), 0)
            if rc not in (0, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                self.check("cuCtxEnablePeerAccess", rc)
        finally:
            self.pop()

    def address_range(self, ptr: int) -> Tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(
            "cuMemGetAddressRange", self.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), ptr)
        )
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        h = _CUipcMemHandle()
        self.check("cuIpcGetMemHandle", self.cuIpcGetMemHandle(ctypes.byref(h), base))
        return bytes(h)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != ctypes.sizeof(_CUipcMemHandle):
            raise ValueError(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
        h = _CUipcMemHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self.check(
            "cuIpcOpenMemHandle",
            self.cuIpcOpenMemHandle(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        )
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.check("cuIpcCloseMemHandle", self.cuIpcCloseMemHandle(ptr))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self.cuMemcpyDtoDAsync(dst, src, nbytes, ctypes.c_void_p(stream))
        if rc != 0:
            self.check("cuMemcpyDtoDAsync", rc)


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _CUmemLocation),
        ("dstLocHint", _CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1


def prepare_batch(copies, src_dev: int, dst_dev: int) -> tuple:
    """The argument arrays of one cuMemcpyBatchAsync for ``copies`` (dst, src,
    nbytes), built once and reused while the copies stay the same."""
    n = len(copies)
    dsts = (ctypes.c_uint64 * n)(*[c[0] for c in copies])
    srcs = (ctypes.c_uint64 * n)(*[c[1] for c in copies])
    sizes = (ctypes.c_size_t * n)(*[c[2] for c in copies])
    attr = _CUmemcpyAttributes(
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        _CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, src_dev),
        _CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dst_dev),
        0,
    )
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    # keep every ctypes object referenced with its pointers
    return (dsts, srcs, sizes, n, attr, idx, fail)


def launch_batch(drv: "_Driver", prepared: tuple, stream: int) -> None:
    if drv.cuMemcpyBatchAsync is None:
        raise CudaDriverError("cuMemcpyBatchAsync", -1, "not in this driver")
    dsts, srcs, sizes, n, attr, idx, fail = prepared
    args = [ctypes.cast(dsts, ctypes.c_void_p), ctypes.cast(srcs, ctypes.c_void_p),
            ctypes.cast(sizes, ctypes.c_void_p), n, ctypes.cast(ctypes.pointer(attr), ctypes.c_void_p),
            ctypes.cast(idx, ctypes.c_void_p), 1]
    if not drv._batch_v2:
        args.append(ctypes.cast(ctypes.pointer(fail), ctypes.c_void_p))
    args.append(ctypes.c_void_p(stream))
    drv.check("cuMemcpyBatchAsync", drv.cuMemcpyBatchAsync(*args))


def memcpy_batch_async(drv: "_Driver", copies, stream: int, src_dev: int, dst_dev: int) -> None:
    """All ``copies`` (dst, src, nbytes) with one cuMemcpyBatchAsync call."""
    launch_batch(drv, prepare_batch(copies, src_dev, dst_dev), stream)


# An SM copy kernel over all tensors at once (one launch instead of one copy
# per tensor). Experimental: needs CuPy (NVRTC) in the receiving process.
_KERNEL_SRC = r"""
extern "C" __global__ void __launch_bounds__(512)
sglang_multi_copy(const unsigned long long* __restrict__ tab, const int nchunks) {
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        unsigned char* dst = (unsigned char*)tab[3 * c];
        const unsigned char* src = (const unsigned char*)tab[3 * c + 1];
        const unsigned long long n = tab[3 * c + 2];
        const bool aligned = ((((unsigned long long)dst) | ((unsigned long long)src)) & 15ULL) == 0ULL;
        const unsigned long long nv = aligned ? (n >> 4) : 0ULL;
        const uint4* s4 = (const uint4*)src;
        uint4* d4 = (uint4*)dst;
        const unsigned long long b = blockDim.x;
        for (unsigned long long i = threadIdx.x; i < nv; i += 4ULL * b) {
            uint4 r0, r1, r2, r3;
            r0 = s4[i];
            if (i + b < nv) r1 = s4[i + b];
            if (i + 2ULL * b < nv) r2 = s4[i + 2ULL * b];
            if (i + 3ULL * b < nv) r3 = s4[i + 3ULL * b];
            d4[i] = r0;
            if (i + b < nv) d4[i + b] = r1;
            if (i + 2ULL * b < nv) d4[i + 2ULL * b] = r2;
            if (i + 3ULL * b < nv) d4[i + 3ULL * b] = r3;
        }
        for (unsigned long long i = (nv << 4) + threadIdx.x; i < n; i += b) dst[i] = src[i];
    }
}
"""
_kernels: Dict[int, Any] = {}


def chunk_table(copies, chunk: int = 1 << 20):
    import numpy as np

    d = np.array([c[0] for c in copies], dtype=np.uint64)
    s = np.array([c[1] for c in copies], dtype=np.uint64)
    n = np.array([c[2] for c in copies], dtype=np.uint64)
    k = (n + np.uint64(chunk - 1)) // np.uint64(chunk)
    idx = np.repeat(np.arange(len(copies)), k.astype(np.int64))
    first = np.repeat(np.cumsum(k) - k, k.astype(np.int64))
    off = (np.arange(int(k.sum()), dtype=np.uint64) - first) * np.uint64(chunk)
    length = np.minimum(np.uint64(chunk), n[idx] - off)
    return np.stack([d[idx] + off, s[idx] + off, length], axis=1).astype(np.uint64).ravel()


def sm_copy(copies, ordinal: int, stream: int, blocks_per_sm: int = 2, threads: int = 512,
            chunk: int = 1 << 20, table=None) -> None:
    """Copy with one kernel launch on ``ordinal`` (peer pointers allowed)."""
    import cupy as cp
    import numpy as np

    with cp.cuda.Device(ordinal):
        k = _kernels.get(ordinal)
        if k is None:
            k = _kernels[ordinal] = cp.RawKernel(_KERNEL_SRC, "sglang_multi_copy")
        tab = chunk_table(copies, chunk) if table is None else table
        nchunks = len(tab) // 3
        import torch

        grid = max(1, min(nchunks, torch.cuda.get_device_properties(ordinal).multi_processor_count * blocks_per_sm))
        with cp.cuda.ExternalStream(stream, ordinal):
            tab_dev = cp.asarray(tab)
            k((grid,), (threads,), (tab_dev, np.int32(nchunks)))
            # keep the table alive until the kernel ran
            cp.cuda.get_current_stream().synchronize()


_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_ordinal_of(uuid_str: str) -> Optional[int]:
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid_str:
            return i
    return None


def plan_copies(copies: List[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """Merge copies that continue each other on both sides: (dst, src, nbytes)."""
    out: List[List[int]] = []
    for dst, src, n in copies:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1][2] += n
        else:
            out.append([dst, src, n])
    return [tuple(c) for c in out]


def spread(copies: List[Tuple[int, int, int]], nstreams: int) -> List[List[Tuple[int, int, int]]]:
    """Split copies over ``nstreams`` queues, each about the same bytes, order kept."""
    nstreams = max(1, min(nstreams, len(copies)))
    total = sum(c[2] for c in copies)
    queues: List[List[Tuple[int, int, int]]] = [[] for _ in range(nstreams)]
    acc, q = 0, 0
    for c in copies:
        while q < nstreams - 1 and acc >= total * (q + 1) / nstreams:
            q += 1
        queues[q].append(c)
        acc += c[2]
    return [x for x in queues if x]


# --------------------------------------------------------------------------- #
# The transport
# --------------------------------------------------------------------------- #
try:  # Ray is optional for importing this module (the pure helpers above).
    from ray.experimental.rdt.tensor_transport_manager import (
        CommunicatorMetadata,
        TensorTransportManager,
        TensorTransportMetadata,
    )
except ImportError:  # pragma: no cover
    CommunicatorMetadata = object  # type: ignore
    TensorTransportManager = object  # type: ignore
    TensorTransportMetadata = object  # type: ignore


@dataclass
class IpcCommunicatorMetadata(CommunicatorMetadata):  # type: ignore[misc]
    """Nothing: one-sided."""


@dataclass
class IpcPart:
    node_id: str
    sender: str  # one token per sender process
    pid: int
    device_uuid: str
    # (segment base in the sender, segment size, 64-byte IPC handle)
    segments: List[Tuple[int, int, bytes]]
    # per tensor: (segment index, byte offset in the segment, nbytes)
    tensors: List[Tuple[int, int, int]]
    # every segment is a buffer its owner keeps across updates and releases
    # only after asking the receivers to unmap it (WeightSyncClient's buckets)
    persistent: bool = False


@dataclass
class CmaPart:
    """CPU tensors readable with process_vm_readv by a process on this host."""

    node_id: str
    sender: str
    pid: int
    start_time: int  # the sender's /proc/<pid>/stat start time (pid reuse guard)
    tensors: List[Tuple[int, int]]  # (address, nbytes) per tensor


@dataclass
class SglangIpcTransportMetadata(TensorTransportMetadata):  # type: ignore[misc]
    ipc: Optional[IpcPart] = None
    ipc_unavailable: Optional[str] = None
    cma: Optional[CmaPart] = None
    nixl: Any = None  # a NixlTransportMetadata, or None

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class _Mapping:
    handle: bytes
    size: int
    ptr: int
    ordinal: int
    last_used: int
    persistent: bool = False


@dataclass
class _CopyPlan:
    """A checked, mapped and planned pull, kept for the next identical one."""

    key: tuple
    generation: int
    dst_ptrs: List[int]
    segments: List[Tuple[int, int, bytes]]
    tensors: List[Tuple[int, int, int]]
    copies: int
    queues: List[List[Tuple[int, int, int]]]
    streams: list
    batch: Optional[list]
    mappings: List["_Mapping"]


@dataclass
class FetchInfo:
    obj_id: str
    path: str  # "cuda_ipc" | "nixl"
    reason: Optional[str] = None
    tensors: int = 0
    bytes: int = 0
    copies: int = 0
    streams: int = 0
    engine: str = ""
    method: str = ""
    opened: int = 0
    reused: int = 0
    open_seconds: float = 0.0
    copy_seconds: float = 0.0
    seconds: float = 0.0
    plan: str = ""  # "new" | "reused" (the last identical pull's checked copy plan)


class SglangIpcTransport(TensorTransportManager):  # type: ignore[misc]
    max_idle_fetches = 64
    max_senders = 4
    max_plans = 16

    def __init__(self):
        self._token = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._mappings: Dict[Tuple[str, int], _Mapping] = {}
        self._senders: List[str] = []  # oldest first
        self._fetches = 0
        self._streams: Dict[Tuple[int, int], list] = {}
        self.nstreams = int(os.environ.get("SGLANG_RDT_IPC_STREAMS", "1"))
        self.engine = os.environ.get("SGLANG_RDT_IPC_ENGINE", "dst")
        # batch: one cuMemcpyBatchAsync per stream (CUDA 12.8+ driver; falls
        # back to ce once if the driver refuses); ce: one cuMemcpyAsync per
        # tensor; kernel: one SM copy kernel (experimental, needs CuPy)
        self.method = os.environ.get("SGLANG_RDT_IPC_METHOD", "batch")
        self.nixl_fallback = os.environ.get("SGLANG_RDT_IPC_NIXL_FALLBACK", "1") != "0"
        self.cache_mappings = True
        self.last: Optional[FetchInfo] = None
        self.recent: "OrderedDict[str, FetchInfo]" = OrderedDict()  # by object id
        self.counts = {"cuda_ipc": 0, "cma": 0, "nixl": 0}
        self._cma_reader = None
        self._cma_denied: Dict[int, str] = {}  # sender pid -> why reading is refused
        self._warned: set = set()
        self._node_id: Optional[str] = None
        self._ordinals: Dict[str, Optional[int]] = {}
        self._generation = 0  # bumped whenever a mapping closes
        # checked copy plans of recent pulls (one per bucket buffer), reused
        # when a pull is identical: same sender segments, same targets
        self._plans: "OrderedDict[tuple, _CopyPlan]" = OrderedDict()

    def _ordinal(self, uuid_str: str) -> Optional[int]:
        if uuid_str not in self._ordinals:
            self._ordinals[uuid_str] = local_ordinal_of(uuid_str)
        return self._ordinals[uuid_str]

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
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return get_tensor_transport_manager("NIXL")

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[Any]):
        import ray
        import torch

        tensor_meta = [(t.shape, t.dtype) for t in rdt_object]
        device = rdt_object[0].device if rdt_object else None
        meta = SglangIpcTransportMetadata(
            tensor_meta=tensor_meta, tensor_device=device.type if device else None
        )
        if not rdt_object:
            return meta
        if device.type == "cpu":
            return self._extract_cpu(obj_id, rdt_object, meta)
        if self.nixl_fallback or device.type != "cuda":
            # Synchronises the devices before registering, like a NIXL put.
            meta.nixl = self._nixl().extract_tensor_transport_metadata(obj_id, rdt_object)
        if device.type != "cuda":
            meta.ipc_unavailable = f"tensors on {device.type}"
            return meta
        if any(t.device != device for t in rdt_object):
            meta.ipc_unavailable = "tensors on several devices"
            return meta
        if any(not t.is_contiguous() for t in rdt_object):
            raise ValueError("All tensors in an RDT object must be contiguous.")
        if meta.nixl is None:
            torch.cuda.synchronize(device)
        try:
            meta.ipc = self._export(rdt_object, device.index, ray.get_runtime_context().get_node_id())
        except CudaDriverError as e:
            # e.g. expandable_segments (VMM) memory: legacy IPC cannot export it.
            meta.ipc_unavailable = f"CUDA IPC export failed: {e}"
            if meta.nixl is None:
                raise
        return meta

    def _extract_cpu(self, obj_id: str, tensors, meta: "SglangIpcTransportMetadata"):
        import ray

        from sglang.srt.ray.rdt.cma import process_start_time

        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("All tensors in an RDT object must be on one device type.")
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("All tensors in an RDT object must be contiguous.")
        meta.ipc_unavailable = "tensors on cpu"
        if self.nixl_fallback:
            meta.nixl = self._nixl().extract_tensor_transport_metadata(obj_id, tensors)
        start = process_start_time(os.getpid())
        if start is not None:
            meta.cma = CmaPart(
                node_id=ray.get_runtime_context().get_node_id(), sender=self._token,
                pid=os.getpid(), start_time=start,
                tensors=[(t.data_ptr(), t.numel() * t.element_size()) for t in tensors],
            )
        elif meta.nixl is None:
            raise ValueError("/proc is not readable here and NIXL fall-back is off")
        return meta

    def _export(self, tensors, ordinal: int, node_id: str) -> IpcPart:
        drv = driver()
        segments: List[Tuple[int, int, bytes]] = []
        index: Dict[int, int] = {}
        per_tensor = []
        ranges: List[Tuple[int, int, int]] = []  # (base, end, segment index), last few
        drv.push(ordinal)
        try:
            for t in tensors:
                ptr = t.data_ptr()
                nbytes = t.numel() * t.element_size()
                seg = None
                for b, e, i in ranges:
                    if b <= ptr and ptr + nbytes <= e:
                        seg = i
                        break
                if seg is None:
                    base, size = drv.address_range(ptr)
                    seg = index.get(base)
                    if seg is None:
                        seg = index[base] = len(segments)
                        segments.append((base, size, drv.ipc_handle(base)))
                    ranges.append((base, base + size, seg))
                    if len(ranges) > 8:
                        ranges.pop(0)
                base = segments[seg][0]
                per_tensor.append((seg, ptr - base, nbytes))
        finally:
            drv.pop()
        with _persistent_lock:
            persistent = bool(segments) and all(
                _persistent.get((ordinal, base)) == size for base, size, _ in segments
            )
        return IpcPart(
            node_id=node_id, sender=self._token, pid=os.getpid(),
            device_uuid=device_uuid(ordinal), segments=segments, tensors=per_tensor,
            persistent=persistent,
        )

    def get_communicator_metadata(self, src_actor, dst_actor, backend=None):
        return IpcCommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None):
        meta = tensor_transport_metadata
        assert isinstance(meta, SglangIpcTransportMetadata), type(meta)
        if not meta.tensor_meta:
            return []
        t0 = time.perf_counter()
        # CPU tensors: process_vm_readv; GPU tensors: CUDA IPC; else NIXL.
        if meta.cma is not None:
            path, why, recv = "cma", self._cma_unusable(meta, target_buffers), self._recv_cma
        else:
            path, why, recv = "cuda_ipc", self._ipc_unusable(meta, target_buffers), self._recv_ipc
        if why is None:
            try:
                info = FetchInfo(obj_id=obj_id, path=path)
                out = recv(meta, target_buffers, info)
                info.seconds = time.perf_counter() - t0
                self._done(info)
                return out
            except _MappingFailed as e:
                # Refused before any byte moved: NIXL can still serve this fetch.
                why = str(e)
                if path == "cuda_ipc" and meta.nixl is None:
                    raise RuntimeError(f"CUDA IPC fetch failed and the ref has no NIXL metadata: {why}") from e
        if meta.nixl is None:
            raise ValueError(
                f"this {TRANSPORT_NAME} ref can only be read over same-node IPC, which is "
                f"not possible here ({why}); put it with SGLANG_RDT_IPC_NIXL_FALLBACK=1"
            )
        if why not in self._warned:
            self._warned.add(why)
            logger.info("[RDT] %s: reading through NIXL (%s)", TRANSPORT_NAME, why)
        from ray.experimental.rdt.nixl_tensor_transport import NixlCommunicatorMetadata

        out = self._nixl().recv_multiple_tensors(obj_id, meta.nixl, NixlCommunicatorMetadata(), target_buffers)
        info = FetchInfo(
            obj_id=obj_id, path="nixl", reason=why, tensors=len(meta.tensor_meta),
            bytes=sum(t.numel() * t.element_size() for t in out),
            seconds=time.perf_counter() - t0,
        )
        self._done(info)
        return out

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError(f"{TRANSPORT_NAME} is one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        if getattr(tensor_transport_meta, "nixl", None) is not None:
            self._nixl().garbage_collect(obj_id, tensor_transport_meta.nixl, tensors)

    def abort_transport(self, obj_id, communicator_metadata):
        from ray.experimental.rdt.nixl_tensor_transport import NixlCommunicatorMetadata

        # An IPC copy is short and synchronous; only a NIXL read can be in flight.
        self._nixl().abort_transport(obj_id, NixlCommunicatorMetadata())

    # -- receive CPU tensors with process_vm_readv ----------------------------- #
    def _cma_unusable(self, meta: SglangIpcTransportMetadata, targets) -> Optional[str]:
        import ray

        from sglang.srt.ray.rdt.cma import process_start_time

        cma = meta.cma
        if os.environ.get("SGLANG_RDT_CMA", "1") == "0":
            return "SGLANG_RDT_CMA=0"
        if targets and any(t.device.type != "cpu" for t in targets):
            return f"target buffers on {sorted({str(t.device) for t in targets})}"
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        if self._node_id != cma.node_id:
            return "the sender is on another node"
        if process_start_time(cma.pid) != cma.start_time:
            return (
                f"the sender process {cma.pid} is not visible from here (another PID "
                "namespace?) or has exited"
            )
        return self._cma_denied.get(cma.pid)

    def _recv_cma(self, meta: SglangIpcTransportMetadata, targets, info: FetchInfo):
        import torch

        from sglang.srt.ray.rdt.cma import CmaError, CmaReader, process_start_time

        cma = meta.cma
        if targets:
            tensors = list(targets)
        else:
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in meta.tensor_meta]
        if len(tensors) != len(cma.tensors):
            raise ValueError(
                f"Length of tensor_buffers ({len(tensors)}) does not match length from object metadata ({len(cma.tensors)})."
            )
        for i, (t, (_, nbytes)) in enumerate(zip(tensors, cma.tensors)):
            if t.nbytes != nbytes or not t.is_contiguous():
                raise ValueError(f"target buffer {i} is not a contiguous buffer of {nbytes} bytes")
        with self._lock:
            if self._cma_reader is None:
                self._cma_reader = CmaReader()
            reader = self._cma_reader
        copies = plan_copies([(t.data_ptr(), a, n) for t, (a, n) in zip(tensors, cma.tensors)])
        info.tensors, info.bytes = len(tensors), sum(n for _, n in cma.tensors)
        info.copies, info.streams, info.method = len(copies), reader.threads, "process_vm_readv"
        if not copies:
            return tensors
        why = reader.probe(cma.pid, copies[0][1])
        if why is not None:
            # Nothing was written; remember it for this sender and use NIXL.
            self._cma_denied[cma.pid] = why
            raise _MappingFailed(why)
        t1 = time.perf_counter()
        try:
            reader.read(cma.pid, copies)
        except CmaError as e:
            raise RuntimeError(
                f"{TRANSPORT_NAME} CPU read from sender pid {cma.pid} broke mid-way: {e}"
            ) from e
        if process_start_time(cma.pid) != cma.start_time:
            raise RuntimeError(
                f"{TRANSPORT_NAME}: the sender process {cma.pid} exited during the read; "
                "the bytes read cannot be trusted"
            )
        info.copy_seconds = time.perf_counter() - t1
        return tensors

    # -- receive over CUDA IPC ---------------------------------------------- #
    def _ipc_unusable(self, meta: SglangIpcTransportMetadata, targets) -> Optional[str]:
        import ray
        import torch

        if meta.ipc is None:
            return meta.ipc_unavailable or "the sender put no CUDA IPC handles"
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        if self._node_id != meta.ipc.node_id:
            return "the sender is on another node"
        if self._ordinal(meta.ipc.device_uuid) is None:
            return (
                f"the sender's GPU {meta.ipc.device_uuid} is not visible here (set "
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 for the receiving actors)"
            )
        if targets:
            devs = {t.device for t in targets}
            if len(devs) != 1 or next(iter(devs)).type != "cuda":
                return f"target buffers on {sorted(map(str, devs))}"
        return None

    def _streams_for(self, ordinal: int) -> list:
        import torch

        n = max(1, self.nstreams)
        streams = self._streams.get((ordinal, n))
        if streams is None:
            streams = self._streams[(ordinal, n)] = [
                torch.cuda.Stream(device=ordinal) for _ in range(n)
            ]
        return streams

    def _recv_ipc(self, meta: SglangIpcTransportMetadata, targets, info: FetchInfo):
        import torch

        ipc = meta.ipc
        if targets:
            tensors = list(targets)
        else:
            dev = torch.device("cuda", torch.cuda.current_device())
            tensors = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in meta.tensor_meta]
        if len(tensors) != len(ipc.tensors):
            raise ValueError(
                f"Length of tensor_buffers ({len(tensors)}) does not match length from object metadata ({len(ipc.tensors)})."
            )
        dst_ptrs = [t.data_ptr() for t in tensors]
        dst_ord = tensors[0].device.index
        src_ord = self._ordinal(ipc.device_uuid)
        engine_ord = src_ord if self.engine == "src" else dst_ord
        info.tensors, info.bytes = len(tensors), sum(n for _, _, n in ipc.tensors)
        info.engine = self.engine
        key = (ipc.sender, engine_ord, dst_ord, src_ord, self.method, self.nstreams)

        drv = driver()
        with self._lock:
            self._fetches += 1
            t0 = time.perf_counter()
            pk = (key, dst_ptrs[0] if dst_ptrs else 0, len(dst_ptrs))
            plan = self._plans.get(pk)
            if not (
                plan is not None and self.cache_mappings
                and plan.generation == self._generation and plan.dst_ptrs == dst_ptrs
                and plan.segments == ipc.segments and plan.tensors == ipc.tensors
            ):
                # Not a pull seen before: check, map and plan afresh.
                self._plans.pop(pk, None)
                check_contiguous = not targets  # Ray checked given targets
                for i, (t, (_, _, nbytes)) in enumerate(zip(tensors, ipc.tensors)):
                    if t.nbytes != nbytes or (check_contiguous and not t.is_contiguous()):
                        raise ValueError(f"target buffer {i} is not a contiguous buffer of {nbytes} bytes")
                if engine_ord != dst_ord:
                    drv.enable_peer_access(engine_ord, dst_ord)
                mapped = self._map_segments(ipc, engine_ord, info)
                copies = plan_copies(
                    [(d, mapped[seg] + off, n) for d, (seg, off, n) in zip(dst_ptrs, ipc.tensors)]
                )
                streams = self._streams_for(engine_ord)
                queues = spread(copies, len(streams))
                plan = _CopyPlan(
                    key=key, generation=self._generation, dst_ptrs=dst_ptrs,
                    segments=ipc.segments, tensors=ipc.tensors, copies=len(copies),
                    queues=queues, streams=streams[: len(queues)],
                    batch=[prepare_batch(q, src_ord, dst_ord) for q in queues]
                    if self.method == "batch" else None,
                    mappings=[self._mappings[(ipc.sender, base)] for base, _, _ in ipc.segments],
                )
                if self.cache_mappings:
                    self._plans[pk] = plan
                    while len(self._plans) > self.max_plans:
                        self._plans.popitem(last=False)
                info.plan = "new"
            else:
                # The same tensors from the same sender segments into the same
                # targets, and no mapping closed since: reuse the plan.
                info.reused = len(plan.mappings)
                info.plan = "reused"
                self._plans.move_to_end(pk)
                self._touch_sender(ipc.sender)
            info.open_seconds = time.perf_counter() - t0
            info.copies, info.streams, info.method = plan.copies, len(plan.queues), self.method
            t1 = time.perf_counter()
            # The copies start after what the receiver already queued on its
            # device (same-process events: safe even across GPUs).
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dst_ord))
            drv.push(engine_ord)
            try:
                for i, (q, s) in enumerate(zip(plan.queues, plan.streams)):
                    s.wait_event(ready)
                    h = s.cuda_stream
                    if self.method == "kernel":
                        sm_copy(q, engine_ord, h)
                        continue
                    if self.method == "batch":
                        try:
                            launch_batch(drv, plan.batch[i], h)
                            continue
                        except CudaDriverError as e:
                            # Validation failed before anything was queued;
                            # the copies are idempotent anyway.
                            logger.warning("[RDT] cuMemcpyBatchAsync refused (%s): one copy per tensor from now on", e)
                            self.method = info.method = "ce"
                            self._plans.clear()
                    for dst, src, n in q:
                        drv.memcpy_async(dst, src, n, h)
            finally:
                drv.pop()
            # Bookkeeping while the copy engine works.
            for m in plan.mappings:
                m.last_used = self._fetches
            self._evict(keep_sender=ipc.sender, keep=plan.mappings)
            for s in plan.streams:
                s.synchronize()  # host-side: no cross-GPU event wait
            info.copy_seconds = time.perf_counter() - t1
            if not self.cache_mappings:
                self._close_pending()
        return tensors

    def _touch_sender(self, sender: str) -> None:
        if not self._senders or self._senders[-1] != sender:
            if sender in self._senders:
                self._senders.remove(sender)
            self._senders.append(sender)

    def _map_segments(self, ipc: IpcPart, ordinal: int, info: FetchInfo) -> List[int]:
        drv = driver()
        self._touch_sender(ipc.sender)
        out = []
        opened_now: List[Tuple[str, int]] = []
        drv.push(ordinal)
        try:
            for base, size, handle in ipc.segments:
                key = (ipc.sender, base)
                m = self._mappings.get(key)
                if m is not None and (m.handle != handle or m.size != size or m.ordinal != ordinal):
                    # The sender freed that segment; a new one lives there now.
                    self._close(key)
                    m = None
                if m is None:
                    try:
                        ptr = drv.ipc_open(handle)
                    except CudaDriverError as e:
                        for k in opened_now:
                            self._close(k)
                        raise _MappingFailed(f"cuIpcOpenMemHandle: {e}") from e
                    m = self._mappings[key] = _Mapping(
                        handle, size, ptr, ordinal, self._fetches, persistent=ipc.persistent
                    )
                    opened_now.append(key)
                    info.opened += 1
                else:
                    info.reused += 1
                m.last_used = self._fetches
                out.append(m.ptr)
        finally:
            drv.pop()
        if not self.cache_mappings:
            self._pending_close = list(opened_now)
        return out

    def _close(self, key) -> None:
        m = self._mappings.pop(key, None)
        if m is None:
            return
        self._generation += 1  # a cached copy plan may point into it
        self._plans.clear()
        drv = driver()
        drv.push(m.ordinal)
        try:
            drv.ipc_close(m.ptr)
        except CudaDriverError as e:  # pragma: no cover - best effort
            logger.warning("[RDT] closing a CUDA IPC mapping failed: %s", e)
        finally:
            drv.pop()

    def _close_pending(self) -> None:
        for k in getattr(self, "_pending_close", []):
            self._close(k)
        self._pending_close = []

    def _evict(self, keep_sender: str, keep=()) -> None:
        if not self.cache_mappings:
            return  # closed after the copy (_close_pending)
        while len(self._senders) > self.max_senders:
            old = self._senders.pop(0)
            for k in [k for k in self._mappings if k[0] == old]:
                self._close(k)
        if len(self._mappings) > len(keep):
            for k, m in list(self._mappings.items()):
                if self._fetches - m.last_used > self.max_idle_fetches:
                    self._close(k)

    def close_all(self, keep_persistent: bool = False) -> int:
        """Close cached mappings; with ``keep_persistent``, keep those of
        buffers their senders declared persistent (see :func:`mark_persistent`)."""
        with self._lock:
            keys = [k for k, m in self._mappings.items() if not (keep_persistent and m.persistent)]
            for k in keys:
                self._close(k)
            live = {k[0] for k in self._mappings}
            self._senders = [x for x in self._senders if x in live]
            return len(keys)

    def release_sender(self, sender: Optional[str] = None) -> int:
        """Close the mappings of one sender (all senders: ``None``)."""
        with self._lock:
            keys = [k for k in self._mappings if sender is None or k[0] == sender]
            for k in keys:
                self._close(k)
            self._senders = [x for x in self._senders if sender is not None and x != sender]
            return len(keys)

    def _done(self, info: FetchInfo) -> None:
        self.last = info
        self.recent[info.obj_id] = info
        while len(self.recent) > 256:
            self.recent.popitem(last=False)
        self.counts[info.path] = self.counts.get(info.path, 0) + 1

    def mapping_stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "mappings": len(self._mappings),
                "mapped_bytes": sum(m.size for m in self._mappings.values()),
                "senders": len(self._senders),
                "fetches": dict(self.counts),
            }


class _MappingFailed(RuntimeError):
    pass


# --------------------------------------------------------------------------- #
# Registration and helpers for receivers
# --------------------------------------------------------------------------- #
_register_lock = threading.Lock()


def register() -> str:
    """Register the transport in this process (idempotent). Returns its name.

    Call it in the process that creates the actors, before creating them, and
    in every actor that puts or gets with it (Ray's own push to a new actor is
    asynchronous and can lose the race against the actor's first call).
    """
    import torch
    from ray.experimental.rdt import util

    from sglang.srt.ray.rdt.nixl_progress import configure_nixl_progress_thread

    # SGLANG_IPC refs carry NIXL metadata, so this process gets a NIXL agent:
    # keep its progress thread from spinning a core (see nixl_progress).
    configure_nixl_progress_thread()
    with _register_lock:
        util._ensure_default_transports_registered()
        if TRANSPORT_NAME not in util.transport_manager_info:
            try:
                util.register_tensor_transport(
                    TRANSPORT_NAME, ["cuda", "cpu"], SglangIpcTransport, torch.Tensor
                )
            except ValueError as e:  # registered by Ray's push in between
                if "already registered" not in str(e):
                    raise
    return TRANSPORT_NAME


def transport() -> SglangIpcTransport:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    register()
    return get_tensor_transport_manager(TRANSPORT_NAME)


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
    from ray.experimental.rdt import util

    if TRANSPORT_NAME not in util.transport_managers:
        return 0
    return transport().close_all(keep_persistent=keep_persistent)


def release_sender_mappings(sender: Optional[str] = None) -> int:
    """Close this process's mappings of ``sender``'s memory (every sender: None)."""
    from ray.experimental.rdt import util

    if TRANSPORT_NAME not in util.transport_managers:
        return 0
    return transport().release_sender(sender)


# --------------------------------------------------------------------------- #
# Sender side: buffers kept across updates
# --------------------------------------------------------------------------- #
# (device ordinal, segment base) -> segment size of CUDA buffers that stay
# allocated across updates. Refs whose segments are all listed say so, and
# receivers keep those mappings when an update ends (re-opening a 1 GiB
# mapping costs 10-13 ms on H200s). The owner must make every receiver
# release them (release_sender_mappings, through the engine) before it frees
# or re-allocates such a buffer.
_persistent: Dict[Tuple[int, int], int] = {}
_persistent_lock = threading.Lock()


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
    with _persistent_lock:
        _persistent[(ordinal, base)] = size
    return True


def unmark_persistent(t) -> None:
    if not getattr(t, "is_cuda", False):
        return
    with _persistent_lock:
        for k in [k for k in _persistent if k == (t.device.index, t.data_ptr())]:
            del _persistent[k]


def sender_token() -> str:
    """This process's sender identity in the refs it puts (receivers key their
    mappings by it)."""
    return transport()._token
