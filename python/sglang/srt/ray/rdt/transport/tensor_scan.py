"""What a sender needs of each tensor (address, size, device, dtype, shape, contiguity), read in one call.

The call is ``csrc/tensor_scan.cpp``, compiled on first use into sglang's JIT cache; without a C++ compiler, with
``SGLANG_RDT_NATIVE_SCAN=0``, or for tensor subclasses, the same arrays are read through Python."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import itertools
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "tensor_scan.cpp"
MODULE = "sglang_rdt_tensor_scan"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SHAPE, _DTYPE, _NBYTES = attrgetter("shape"), attrgetter("dtype"), attrgetter("nbytes")


class NotATensor(TypeError):
    """Item ``index`` of the list is not a ``torch.Tensor``."""

    def __init__(self, index: int, obj: Any):
        super().__init__(f"item {index} is a {type(obj).__name__}, not a torch.Tensor")
        self.index = index


@dataclass
class Scan:
    """Per tensor of a list: address, bytes, device, dtype code, shape, contiguity."""

    ptrs: np.ndarray  # int64
    nbytes: np.ndarray  # int64
    device: np.ndarray  # int64: CUDA ordinal, -1 in host memory
    dtype: np.ndarray  # int64: a code per dtype (:func:`dtypes_of`)
    ndim: np.ndarray  # int64
    dims: np.ndarray  # int64: every tensor's sizes, one after the other
    contiguous: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.ptrs)

    def same_layout(self, other: "Scan") -> bool:
        """Whether both lists hold tensors of the same shapes and dtypes, in order."""
        return (self.dtype.tobytes() == other.dtype.tobytes() and self.ndim.tobytes() == other.ndim.tobytes()
                and self.dims.tobytes() == other.dims.tobytes())

    def shapes(self) -> List[Tuple[int, ...]]:
        dims, out, at = self.dims.tolist(), [], 0
        for n in self.ndim.tolist():
            out.append(tuple(dims[at:at + n]))
            at += n
        return out

    def dtypes(self) -> List[torch.dtype]:
        table = _dtype_table()[1]
        return [table[c] for c in self.dtype.tolist()]

    def part(self, start: int, stop: int) -> "Scan":
        at = int(self.ndim[:start].sum())
        end = at + int(self.ndim[start:stop].sum())
        return Scan(self.ptrs[start:stop], self.nbytes[start:stop], self.device[start:stop], self.dtype[start:stop],
                    self.ndim[start:stop], self.dims[at:end], self.contiguous[start:stop])


def scan(tensors: List[Any]) -> Scan:
    """A :class:`Scan` of ``tensors``; raises :class:`NotATensor` naming the first item that is not a tensor."""
    if not isinstance(tensors, list):
        tensors = list(tensors)
    mod = native()
    if mod is not None:
        out = mod.scan(tensors)
        if not isinstance(out, int):
            *int64s, contiguous = out  # ptrs, nbytes, device, dtype, ndim, dims; then a bool per tensor
            return Scan(*[np.frombuffer(b, np.int64) for b in int64s], np.frombuffer(contiguous, np.bool_))
        if not isinstance(tensors[out], torch.Tensor):
            raise NotATensor(out, tensors[out])
    return _scan_python(tensors)


def _scan_python(tensors: List[Any]) -> Scan:
    """The same arrays, through Python (a tensor subclass's own methods answer)."""
    if not set(map(type, tensors)) <= set(_PLAIN):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise NotATensor(i, t)
    n = len(tensors)
    shapes = list(map(_SHAPE, tensors))
    ndim = np.fromiter(map(len, shapes), np.int64, n)
    codes = _dtype_table()[0]
    dtype = np.fromiter((codes.get(d) if d in codes else _new_code(d) for d in map(_DTYPE, tensors)), np.int64, n)
    return Scan(np.fromiter(map(torch.Tensor.data_ptr, tensors), np.int64, n),
                np.fromiter(map(_NBYTES, tensors), np.int64, n),
                np.fromiter(map(torch.Tensor.get_device, tensors), np.int64, n),
                dtype, ndim, np.fromiter(itertools.chain.from_iterable(shapes), np.int64, int(ndim.sum())),
                np.fromiter(map(torch.Tensor.is_contiguous, tensors), np.bool_, n))


def prepare() -> None:
    """Build or load the extension and its dtype table now (a client does at construction), not in an update."""
    _dtype_table()


_codes: Optional[Tuple[Dict[torch.dtype, int], Dict[int, torch.dtype]]] = None
_lock = threading.Lock()  # guards building the extension and the dtype table once


def _dtype_table() -> Tuple[Dict[torch.dtype, int], Dict[int, torch.dtype]]:
    """``({dtype: code}, {code: dtype})``, with the native scan's codes (torch's ScalarType) when it is there."""
    global _codes
    if _codes is None:
        mod = native()
        code_of: Dict[torch.dtype, int] = {}
        for d in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
            try:
                with warnings.catch_warnings():  # experimental dtypes warn
                    warnings.simplefilter("ignore")
                    out = mod.scan([torch.empty(0, dtype=d)]) if mod is not None else None
            except Exception:  # a dtype torch cannot make here
                continue
            code_of[d] = int(np.frombuffer(out[3], np.int64)[0]) if isinstance(out, tuple) else len(code_of)
        _codes = (code_of, {c: d for d, c in code_of.items()})
    return _codes


def _new_code(dtype: torch.dtype) -> int:
    code_of, dtype_of = _dtype_table()
    with _lock:
        if dtype not in code_of:
            code_of[dtype] = 1 << 20 | len(code_of)
            dtype_of[code_of[dtype]] = dtype
    return code_of[dtype]


_native: Any = None
_native_tried = False


def native():
    """The compiled scan (built on first use), or None: then Python reads."""
    global _native, _native_tried
    if _native_tried:
        return _native
    with _lock:
        if not _native_tried:
            from sglang.srt.environ import envs

            if envs.SGLANG_RDT_NATIVE_SCAN.get():
                try:
                    _native = load()
                except Exception as e:
                    logger.warning("[RDT] no native tensor scan (%s); the client reads each tensor "
                                   "through Python (slower for thousands of tensors)", e)
            _native_tried = True
    return _native


def cache_dir() -> Path:
    from sglang.srt.environ import envs

    jit = envs.SGLANG_JIT_CACHE_DIR.get()
    base = Path(jit) if jit else Path(os.path.expanduser(envs.SGLANG_CACHE_DIR.get())) / "jit"
    return base / "rdt"


def load():
    """Build (unless the cache has it) and import the extension."""
    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(),
                                     sys.version.encode(), str(abi).encode()])).hexdigest()[:16]
    out = cache_dir() / f"tensor_scan-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build; other processes wait for it
            if not out.exists():
                logger.info("[RDT] compiling the tensor scan into %s (once per torch version)", out)
                _build(out, torch_dir, abi)
    spec = importlib.util.spec_from_file_location(MODULE, out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.set_types(*_PLAIN)
    return mod


def _build(out: Path, torch_dir: Path, abi: int) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX)")
    lib = torch_dir / "lib"
    flags = ["-O2", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
             f"-I{sysconfig.get_paths()['include']}", str(SOURCE),
             f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    errors = ""
    for std in ("-std=c++20", "-std=c++17"):  # what the installed torch's headers need
        p = subprocess.run([cxx, std, *flags, "-o", str(tmp)], capture_output=True, text=True, timeout=900)
        if p.returncode == 0:
            os.replace(tmp, out)
            return
        errors = p.stderr.strip()
    raise RuntimeError(f"compiling {SOURCE.name} failed: {errors[-500:]}")
