"""Cross-memory attach: host-memory tensors copied out of another process on this host (``process_vm_readv``).

Needs ptrace rights over the sender; a one-byte probe finds a refusal before any byte moves (NIXL then serves the
read). Every read checks the sender's start time before and after copying (a pid can be reused).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import threading
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from sglang.srt.ray.rdt.transport.metadata import CmaPart, MappingFailed, ReadResult

# Linux caps one call at IOV_MAX (1024) iovecs per side.
IOV_MAX = 1024

Copy = Tuple[int, int, int]  # (local destination, remote source, nbytes)
# How often a wait looks whether the other process still exists.
LIVENESS_CHECK_S = 0.25


class CmaError(RuntimeError):
    def __init__(self, message: str, err: int = 0):
        super().__init__(message)
        self.errno = err


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = None
_libc_lock = threading.Lock()  # loading libc once


def _readv():
    global _libc
    with _libc_lock:
        if _libc is None:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
            _libc = fn
        return _libc


def proc_stat_fields(path: str) -> Optional[List[bytes]]:
    """The fields of a ``/proc/.../stat`` file from field 3 on, or None if unreadable."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def process_start_time(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot, or None if not visible."""
    fields = proc_stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else int(fields[19])  # field 22 overall


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one we may not signal counts as alive; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = proc_stat_fields(f"/proc/{pid}/stat")
    return state is None or state[0] not in (b"Z", b"X")


def describe_errno(err: int) -> str:
    name = errno_mod.errorcode.get(err, str(err))
    hint = {
        errno_mod.EPERM: "not permitted: the reader needs ptrace rights over the sender "
        "(same user with kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE)",
        errno_mod.ESRCH: "the sender process is gone",
        errno_mod.EFAULT: "an address is not mapped in the sender (memory freed?)",
        errno_mod.ENOSYS: "process_vm_readv is not available (seccomp?)",
    }.get(err, os.strerror(err))
    return f"process_vm_readv: {name}: {hint}"


def probe(pid: int, src: int) -> Optional[str]:
    """None if one byte at ``src`` can be read from ``pid``, else why not."""
    scratch = ctypes.create_string_buffer(1)
    local = _IoVec(ctypes.cast(scratch, ctypes.c_void_p), 1)
    remote = _IoVec(src, 1)
    got = _readv()(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return None if got == 1 else describe_errno(ctypes.get_errno())


def read_all(pid: int, copies: Sequence[Copy]) -> int:
    """Copy everything, in batches of IOV_MAX, resuming after partial reads; :class:`CmaError` if a part fails."""
    readv = _readv()
    done = 0
    pending = [list(c) for c in copies if c[2]]
    while pending:
        batch = pending[:IOV_MAX]
        n = len(batch)
        local = (_IoVec * n)(*[_IoVec(d, k) for d, _, k in batch])
        remote = (_IoVec * n)(*[_IoVec(s, k) for _, s, k in batch])
        want = sum(k for _, _, k in batch)
        got = readv(pid, local, n, remote, n, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CmaError(f"{describe_errno(err)} (after {done} bytes)", err)
        if got == 0:
            raise CmaError(f"process_vm_readv made no progress after {done} bytes", errno_mod.EIO)
        done += got
        if got == want:
            del pending[:n]
            continue
        # Drop the pairs that landed whole, shorten the one that landed in part.
        left = got
        i = 0
        while left >= batch[i][2]:
            left -= batch[i][2]
            i += 1
        batch[i][0] += left
        batch[i][1] += left
        batch[i][2] -= left
        del pending[:i]
    return done


_START_TIME: dict = {}  # this process's start time, read once


def export_cma(ptrs: np.ndarray, nbytes: np.ndarray, token: str, node_id: str) -> Optional[CmaPart]:
    """A :class:`CmaPart` of host-memory tensors at ``ptrs`` (``nbytes`` each), or None when /proc is unreadable."""
    pid = os.getpid()
    if pid not in _START_TIME:
        _START_TIME[pid] = process_start_time(pid)
    start = _START_TIME[pid]
    if start is None:
        return None
    return CmaPart(node_id=node_id, sender=token, pid=pid, start_time=start, address=ptrs, nbytes=nbytes)


class CmaPath:
    """Reads a :class:`CmaPart` into host-memory targets; a sender the kernel refuses is remembered (NIXL serves it)."""

    def __init__(self):
        self._denied: dict = {}  # sender pid -> why reading is refused

    def unusable(self, part: CmaPart, device, node_id: str) -> Optional[str]:
        """None when this process can read ``part`` into tensors on ``device``."""
        from sglang.srt.environ import envs

        if not envs.SGLANG_RDT_CMA.get():
            return "SGLANG_RDT_CMA=0"
        if device is not None and device.type != "cpu":
            return f"target buffers on {device}"
        if node_id != part.node_id:
            return "the sender is on another node"
        if process_start_time(part.pid) != part.start_time:
            return f"the sender process {part.pid} is not visible from here (another PID namespace?) or has exited"
        return self._denied.get(part.pid)

    def read(self, part: CmaPart, targets, copy: bool = True) -> ReadResult:
        """Read ``part``'s tensors into ``targets`` (``copy=False``: only check that they can be read)."""
        t0 = time.perf_counter()
        targets.check(part.nbytes)
        res = ReadResult("cma", len(targets.tensors), int(part.nbytes.sum()), 0.0, method="process_vm_readv")
        copies = merge_copies(targets.ptrs, part.address, part.nbytes)
        if copies:
            why = probe(part.pid, copies[0][1])
            if why is not None:  # nothing was written: remember it, NIXL may serve
                self._denied[part.pid] = why
                raise MappingFailed(why)
            if copy:
                t1 = time.perf_counter()
                try:
                    read_all(part.pid, copies)
                except CmaError as e:
                    raise RuntimeError(f"process_vm_readv from sender pid {part.pid} broke mid-way: {e}") from e
                if process_start_time(part.pid) != part.start_time:
                    raise RuntimeError(f"the sender process {part.pid} exited during the read; "
                                       "the bytes read cannot be trusted")
                res.copy_seconds = time.perf_counter() - t1
        res.seconds = time.perf_counter() - t0
        return res


def merge_copies(dst, src, nbytes) -> List[Copy]:
    """``(dst, src, nbytes)`` copies, those adjacent on both sides merged, empty ones dropped."""
    out: List[List[int]] = []
    for d, s, n in zip(np.asarray(dst).tolist(), np.asarray(src).tolist(), np.asarray(nbytes).tolist()):
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1][2] += n
        else:
            out.append([d, s, n])
    return [tuple(c) for c in out]  # type: ignore[misc]
