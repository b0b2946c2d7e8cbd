"""The CUDA driver calls of the same-node GPU path, through ctypes.

CUDA IPC handles (export a cudaMalloc segment, open it in another process),
contexts, peer access, and the copy-engine calls (``cuMemcpyAsync`` and the
CUDA 12.8+ ``cuMemcpyBatchAsync``), plus an experimental one-launch SM copy
kernel (needs CuPy). Loaded on first use (:func:`driver`): importing this
module needs neither a GPU nor torch.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Optional, Tuple

# CUDA driver API through ctypes (no extra dependency; loaded on first use)
# --------------------------------------------------------------------------- #
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CUDA_ERROR_ALREADY_MAPPED = 208
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7


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
        self.cuPointerGetAttribute = fn(["cuPointerGetAttribute"], [p, ctypes.c_int, u64])
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

    def buffer_id(self, ptr: int) -> Optional[int]:
        """The process-unique id of the allocation holding ``ptr`` (never reused
        within a process: a segment freed and allocated again gets a new one),
        or None when ``ptr`` is not allocated memory."""
        out = ctypes.c_uint64()
        rc = self.cuPointerGetAttribute(ctypes.byref(out), CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
        return out.value if rc == 0 else None

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

