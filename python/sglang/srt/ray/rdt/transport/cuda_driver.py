"""The CUDA driver and NVRTC calls of the same-node GPU path, through ctypes, and :class:`CopyKernel`.

Loaded on first use (:func:`driver`): importing this module needs neither a GPU nor torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


class _CUipcMemHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array reads back cut at the first NUL; writing through it corrupts memory.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
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
        self.cuDevicePrimaryCtxRetain = fn(["cuDevicePrimaryCtxRetain"], [ctypes.POINTER(p), ctypes.c_int])
        self.cuCtxPushCurrent = fn(["cuCtxPushCurrent_v2", "cuCtxPushCurrent"], [p])
        self.cuCtxPopCurrent = fn(["cuCtxPopCurrent_v2", "cuCtxPopCurrent"], [ctypes.POINTER(p)])
        self.cuCtxEnablePeerAccess = fn(["cuCtxEnablePeerAccess"], [p, ctypes.c_uint])
        self.cuMemGetAddressRange = fn(["cuMemGetAddressRange_v2", "cuMemGetAddressRange"],
                                       [ctypes.POINTER(u64), ctypes.POINTER(sz), u64])
        self.cuIpcGetMemHandle = fn(["cuIpcGetMemHandle"], [ctypes.POINTER(_CUipcMemHandle), u64])
        self.cuPointerGetAttribute = fn(["cuPointerGetAttribute"], [p, ctypes.c_int, u64])
        self.cuIpcOpenMemHandle = fn(["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"],
                                     [ctypes.POINTER(u64), _CUipcMemHandle, ctypes.c_uint])
        self.cuIpcCloseMemHandle = fn(["cuIpcCloseMemHandle"], [u64])
        self.cuMemcpyDtoDAsync = fn(["cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"], [u64, u64, sz, p])
        self.cuModuleLoadData = fn(["cuModuleLoadData"], [ctypes.POINTER(p), p])
        self.cuModuleGetFunction = fn(["cuModuleGetFunction"], [ctypes.POINTER(p), p, ctypes.c_char_p])
        self.cuLaunchKernel = fn(["cuLaunchKernel"],  # grid xyz, block xyz, shared memory bytes
                                 [p] + [ctypes.c_uint] * 7 + [p, ctypes.POINTER(p), ctypes.POINTER(p)])
        self.cuDeviceGetAttribute = fn(["cuDeviceGetAttribute"],
                                       [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int])
        # CUDA 12.8+: one call for a list of copies (13.x: _v2, without failIdx).
        self._batch_v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")
        if self._batch_v2:
            self.cuMemcpyBatchAsync = fn(["cuMemcpyBatchAsync_v2"], [p, p, p, sz, p, p, sz, p])
        elif hasattr(lib, "cuMemcpyBatchAsync"):
            self.cuMemcpyBatchAsync = fn(["cuMemcpyBatchAsync"], [p, p, p, sz, p, p, sz, p, p])
        else:
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
            dev, c = ctypes.c_int(), ctypes.c_void_p()
            self.check("cuDeviceGet", self.cuDeviceGet(ctypes.byref(dev), ordinal))
            self.check("cuDevicePrimaryCtxRetain", self.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev))
            ctx = self._ctx[ordinal] = c.value
        return ctx

    def push(self, ordinal: int) -> None:
        self.check("cuCtxPushCurrent", self.cuCtxPushCurrent(ctypes.c_void_p(self.primary_ctx(ordinal))))

    def pop(self) -> None:
        c = ctypes.c_void_p()
        self.check("cuCtxPopCurrent", self.cuCtxPopCurrent(ctypes.byref(c)))

    def address_range(self, ptr: int) -> Tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check("cuMemGetAddressRange", self.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), ptr))
        return base.value, size.value

    def buffer_id(self, ptr: int) -> Optional[int]:
        """The id of the allocation holding ``ptr`` (process-unique, never reused), or None if not allocated."""
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
        self.check("cuIpcOpenMemHandle",
                   self.cuIpcOpenMemHandle(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.check("cuIpcCloseMemHandle", self.cuIpcCloseMemHandle(ptr))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check("cuMemcpyDtoDAsync", self.cuMemcpyDtoDAsync(dst, src, nbytes, ctypes.c_void_p(stream)))

    def attribute(self, attr: int, ordinal: int) -> int:
        out = ctypes.c_int()
        self.check("cuDeviceGetAttribute", self.cuDeviceGetAttribute(ctypes.byref(out), attr, ordinal))
        return out.value


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1


def memcpy_batch(drv: _Driver, dst, src, nbytes, stream: int, src_dev: int, dst_dev: int) -> None:
    """All copies ``dst[i] <- src[i]`` (``nbytes[i]``) with one cuMemcpyBatchAsync."""
    if drv.cuMemcpyBatchAsync is None:
        raise CudaDriverError("cuMemcpyBatchAsync", -1, "not in this driver")
    n = len(dst)
    dsts = (ctypes.c_uint64 * n)(*map(int, dst))
    srcs = (ctypes.c_uint64 * n)(*map(int, src))
    sizes = (ctypes.c_size_t * n)(*map(int, nbytes))
    attr = _CUmemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                               _CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, src_dev),
                               _CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dst_dev), 0)
    idx = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    args = [ctypes.cast(dsts, ctypes.c_void_p), ctypes.cast(srcs, ctypes.c_void_p),
            ctypes.cast(sizes, ctypes.c_void_p), n, ctypes.cast(ctypes.pointer(attr), ctypes.c_void_p),
            ctypes.cast(idx, ctypes.c_void_p), 1]
    if not drv._batch_v2:
        args.append(ctypes.cast(ctypes.pointer(fail), ctypes.c_void_p))
    args.append(ctypes.c_void_p(stream))
    drv.check("cuMemcpyBatchAsync", drv.cuMemcpyBatchAsync(*args))


KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "copy_kernels.cu"
KERNEL_THREADS = 512
TABLE_THREADS = 256
TILE, STRIDED_BLOCK = 32, (32, 8)  # the strided kernel: tile side (copy_kernels.cu), threads of a block
KERNEL_BLOCKS_PER_SM = 2
CHUNK_BYTES = 256 << 10
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def _load_nvrtc():
    """NVRTC from the system or from PyTorch's CUDA wheels (``nvidia/*/lib``)."""
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True):
            if "builtins" in path or ".alt." in path:
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise OSError("no libnvrtc found (PyTorch's CUDA wheels ship it in nvidia/*/lib)")


def compile_ptx(source: str, arch: str) -> bytes:
    """PTX of ``source`` for ``arch`` (e.g. ``compute_90``) with NVRTC."""
    lib = _load_nvrtc()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"sglang_rdt_copy.cu", 0, None, None)
    if rc != 0:
        raise CudaDriverError("nvrtcCreateProgram", rc, "NVRTC error")

    def text(get_size, get):
        size = ctypes.c_size_t()
        get_size(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        get(prog, buf)
        return buf

    try:
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        rc = lib.nvrtcCompileProgram(prog, 1, opts)
        if rc != 0:
            log = text(lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog).value
            raise CudaDriverError("nvrtcCompileProgram", rc, log.decode(errors="replace")[:500])
        return text(lib.nvrtcGetPTXSize, lib.nvrtcGetPTX).raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class CopyKernel:
    """:data:`KERNEL_SOURCE` loaded on one device: :meth:`launch` copies every chunk of a table in one launch,
    :meth:`strided` lays out non-contiguous views in another."""

    def __init__(self, ordinal: int):
        drv = driver()
        self.ordinal = ordinal
        major = drv.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal)
        minor = drv.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal)
        source = KERNEL_SOURCE.read_text()
        try:
            ptx = compile_ptx(source, f"compute_{major}{minor}")
        except CudaDriverError:  # an NVRTC older than the device: the driver JITs older PTX
            ptx = compile_ptx(source, "compute_75")
        self._ptx = ctypes.create_string_buffer(ptx)
        self.grid_max = KERNEL_BLOCKS_PER_SM * drv.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal)
        self._module = ctypes.c_void_p()
        with pushed(drv, ordinal):
            drv.check("cuModuleLoadData", drv.cuModuleLoadData(ctypes.byref(self._module), self._ptx))
            self._func, self._chunks, self._strided = [self._function(drv, name) for name in (
                b"sglang_rdt_copy", b"sglang_rdt_chunks", b"sglang_rdt_strided")]

    def _function(self, drv: _Driver, name: bytes):
        func = ctypes.c_void_p()
        drv.check("cuModuleGetFunction", drv.cuModuleGetFunction(ctypes.byref(func), self._module, name))
        return func

    def table(self, dst, src, nbytes, same_dst: bool = False):
        """The device table of copies ``dst[i] <- src[i]`` (``nbytes[i]``) in :data:`CHUNK_BYTES` chunks, made on
        the current stream without waiting. ``same_dst``: every chunk lands on ``dst[i]`` (a read of the sources)."""
        import numpy as np
        import torch

        rows, nchunks = copy_rows(dst, src, nbytes)
        device = torch.device("cuda", self.ordinal)
        out = torch.empty(3 * nchunks, dtype=torch.int64, device=device)
        if not nchunks:
            return out
        # Pinned: a pageable upload waits for the stream to drain (a time slice of a busy trainer sharing the GPU).
        rows_dev = torch.from_numpy(rows.view(np.int64)).pin_memory().to(device, non_blocking=True)
        n = len(rows) // 4
        grid = max(1, min((32 * n + TABLE_THREADS - 1) // TABLE_THREADS, self.grid_max * 8))
        args = [ctypes.c_uint64(rows_dev.data_ptr()), ctypes.c_int(n), ctypes.c_uint64(out.data_ptr()),
                ctypes.c_uint64(CHUNK_BYTES), ctypes.c_int(1 if same_dst else 0)]
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        self._launch(self._chunks, grid, TABLE_THREADS, stream, args)
        return out  # rows_dev is freed in stream order, after the kernel read it

    def launch(self, table_ptr: int, nchunks: int, stream: int) -> None:
        """Copy the ``nchunks`` rows ``(dst, src, nbytes)`` of the table at ``table_ptr`` on ``stream``."""
        if nchunks <= 0:
            return
        args = [ctypes.c_uint64(table_ptr), ctypes.c_int(nchunks)]
        self._launch(self._func, max(1, min(nchunks, self.grid_max)), KERNEL_THREADS, stream, args)

    def strided(self, views) -> None:
        """Lay out views row-major in one launch on the current stream, without waiting: ``views`` holds per view
        ``(dst, src, rows, cols, row stride, col stride, element bytes)`` (strides in elements, see
        :func:`strided_rows`; 1, 2, 4 or 8-byte elements; no view empty)."""
        import numpy as np
        import torch

        rows = np.asarray(views, np.int64).reshape(-1, 7)
        if not len(rows):
            return
        tiles = -(-rows[:, 2] // TILE) * -(-rows[:, 3] // TILE)
        ends = np.cumsum(tiles)
        table = np.ascontiguousarray(np.concatenate([rows, (ends - tiles)[:, None]], axis=1))
        device = torch.device("cuda", self.ordinal)
        table_dev = torch.from_numpy(table).pin_memory().to(device, non_blocking=True)
        args = [ctypes.c_uint64(table_dev.data_ptr()), ctypes.c_int(len(rows)), ctypes.c_uint64(int(ends[-1]))]
        stream = torch.cuda.current_stream(self.ordinal).cuda_stream
        self._launch(self._strided, max(1, min(int(ends[-1]), self.grid_max * 8)), STRIDED_BLOCK, stream, args)

    def _launch(self, func, grid: int, block, stream: int, args) -> None:
        """Queue ``func`` on ``stream`` with ``args`` (ctypes values) as its parameters; ``block``: threads (x, y)."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        bx, by = block if isinstance(block, tuple) else (block, 1)
        drv = driver()
        with pushed(drv, self.ordinal):
            drv.check("cuLaunchKernel", drv.cuLaunchKernel(
                func, grid, 1, 1, bx, by, 1, 0, ctypes.c_void_p(stream), params, None))


def copy_rows(dst, src, nbytes, chunk: int = CHUNK_BYTES):
    """``(rows, nchunks)``: per copy ``(dst, src, nbytes, first chunk)``, flat uint64, for :meth:`CopyKernel.table`."""
    import numpy as np

    n = np.asarray(nbytes, dtype=np.int64)
    k = (n + (chunk - 1)) // chunk
    ends = np.cumsum(k)
    rows = np.empty((len(n), 4), np.int64)
    rows[:, 0] = np.asarray(dst, dtype=np.int64)
    rows[:, 1] = np.asarray(src, dtype=np.int64)
    rows[:, 2] = n
    rows[:, 3] = ends - k
    return rows.ravel().view(np.uint64), int(ends[-1]) if len(ends) else 0


def copy_ptrs(ordinal: int, dst, src, nbytes) -> None:
    """Copy ``nbytes[i]`` bytes ``src[i]`` -> ``dst[i]`` on GPU ``ordinal`` in one launch; returns once queued."""
    import torch

    if not len(dst):
        return
    kernel = copy_kernel(ordinal)
    table = kernel.table(dst, src, nbytes)
    kernel.launch(table.data_ptr(), table.numel() // 3, torch.cuda.current_stream(ordinal).cuda_stream)


def strided_rows(dst: int, src: int, shape, strides, esize: int, max_blocks: int = 4096) -> Optional[list]:
    """The rows of :meth:`CopyKernel.strided` laying out the view at ``src`` (``shape``, ``strides`` in elements,
    ``esize``-byte elements) at ``dst`` row-major: dimensions merged where their strides allow, the last two one
    2-D block per index of the others. None for more than ``max_blocks`` blocks."""
    dims: list = []
    for n, s in zip(shape, strides):
        if n != 1 and dims and dims[-1][1] == n * s:
            dims[-1] = (dims[-1][0] * n, s)
        elif n != 1:
            dims.append((n, s))
    if len(dims) == 1 and dims[0][0] % TILE == 0:  # 1-D: as TILE columns, every thread of a tile has work
        dims = [(dims[0][0] // TILE, TILE * dims[0][1]), (TILE, dims[0][1])]
    (r, sr), (c, sc) = ([(1, 0), (1, 0)] + dims)[-2:]
    offs = [0]
    for n, s in dims[:-2]:
        if len(offs) * n > max_blocks:
            return None
        offs = [o + j * s for o in offs for j in range(n)]
    return [(dst + b * r * c * esize, src + o * esize, r, c, sr, sc, esize) for b, o in enumerate(offs)]


_kernels: Dict[int, CopyKernel] = {}
_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()  # guards loading the driver and building kernels


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


@contextlib.contextmanager
def pushed(drv: _Driver, ordinal: int):
    """``drv`` with GPU ``ordinal``'s primary context current (pushed here, popped on the way out)."""
    drv.push(ordinal)
    try:
        yield drv
    finally:
        drv.pop()


def copy_kernel(ordinal: int) -> CopyKernel:
    """The copy kernel on GPU ``ordinal``, built once per process."""
    with _driver_lock:
        kernel = _kernels.get(ordinal)
    if kernel is None:
        kernel = CopyKernel(ordinal)
        with _driver_lock:
            kernel = _kernels.setdefault(ordinal, kernel)
    return kernel


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_ordinal_of(uuid_str: str) -> Optional[int]:
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid_str:
            return i
    return None
