"""GPU tensors between processes of one node: CUDA IPC handles of kept memory, one copy per read.

Only *kept memory* (the staging pool, buffers registered with NIXL, a rank's parameters it granted a writer) is
mapped by another process; other tensors are refused (:class:`NotKept`). The exporter checks its table again whenever
the device freed memory: a segment allocated anew gets a new handle. A reader keeps each segment mapped until the
sender releases it or exits (closed within :data:`WATCH_S`). The sender synchronises before a read, the reader
after its copy. A writer (:meth:`CudaIpcReader.mapped`) maps a rank's parameters the same way and writes them itself.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from sglang.srt.ray.rdt.transport import cuda_driver
from sglang.srt.ray.rdt.transport.cma import pid_alive
from sglang.srt.ray.rdt.transport.cuda_driver import CudaDriverError, device_uuid, local_ordinal_of
from sglang.srt.ray.rdt.transport.metadata import IpcPart, MappingFailed, ReadResult, Targets

logger = logging.getLogger(__name__)

WATCH_S = 1.0
# Lists (base, size) of one GPU's kept segments (the staging pool's).
KeptSource = Callable[[], Iterable[Tuple[int, int]]]


class NotKept(ValueError):
    """Tensor ``index`` does not lie in kept memory: gather it into kept memory first."""

    def __init__(self, index: int):
        super().__init__(f"tensor {index} does not lie in kept memory (the staging pool or a registered buffer)")
        self.index = index


def device_frees(ordinal: int) -> int:
    """How many times PyTorch's allocator gave memory of GPU ``ordinal`` back (the nested form: no flattening)."""
    return int(torch.cuda.memory_stats_as_nested_dict(ordinal).get("num_device_free", 0))


class _KeptTable:
    """One GPU's kept segments, sorted by base: ``(base, size, handle, allocation id)``."""

    def __init__(self, entries=()):
        self.entries = sorted(entries)
        self.bases = np.array([e[0] for e in self.entries], np.int64)
        self.ends = np.array([e[0] + e[1] for e in self.entries], np.int64)

    def find(self, ptrs: np.ndarray, nbytes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.searchsorted(self.bases, ptrs, side="right") - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (ptrs + nbytes <= self.ends[safe]) if len(self.ends) else idx < -1
        return safe, ok


class CudaIpcExporter:
    """Describes tensors in this process's kept GPU memory (see the module docstring)."""

    max_parts = 1024  # descriptions remembered (a model's groups, each update the same)

    def __init__(self, token: str, still_registered: Callable[[int], bool] = lambda ptr: True):
        self.token = token
        self._sources: Dict[int, List[KeptSource]] = {}
        self._registered: Dict[int, set] = {}  # ordinal -> storage addresses registered as kept
        self._still_registered = still_registered  # (a storage deregistered since is looked at no more)
        self._tables: Dict[int, _KeptTable] = {}
        self._frees: Dict[int, int] = {}  # ordinal -> device frees when its table was checked
        # (ordinal, node, addresses, sizes) -> IpcPart: tensors made anew at the same places skip the lookup.
        self._parts: Dict[tuple, IpcPart] = {}
        self._kept_ids = itertools.count(1)
        self._lock = threading.Lock()  # guards the sources, tables and parts

    def add_source(self, ordinal: int, source: KeptSource) -> None:
        with self._lock:
            self._sources.setdefault(ordinal, []).append(source)

    def remove_source(self, ordinal: int, source: KeptSource) -> None:
        """``source``'s memory is about to be freed: look its segments up anew."""
        with self._lock:
            sources = self._sources.get(ordinal, [])
            if source in sources:
                sources.remove(source)
            self._tables.pop(ordinal, None)
            self._parts.clear()

    def keep_registered(self, ordinal: int, storage_ptr: int) -> None:
        """The storage at ``storage_ptr`` is kept by its owner (registered with NIXL)."""
        with self._lock:
            if storage_ptr not in self._registered.setdefault(ordinal, set()):
                self._registered[ordinal].add(storage_ptr)
                self._tables.pop(ordinal, None)

    def kept_mask(self, ptrs: np.ndarray, nbytes: np.ndarray, ordinal: int) -> np.ndarray:
        """Per tensor (contiguous, at ``ptrs``, on GPU ``ordinal``): whether it lies in kept memory."""
        with self._lock:
            self._check_frees(ordinal)
            return self._find(ptrs, nbytes, ordinal)[2]

    def export(self, ptrs: np.ndarray, nbytes: np.ndarray, ordinal: int, node_id: str) -> IpcPart:
        """An :class:`IpcPart` of contiguous tensors at ``ptrs`` (``nbytes`` each, GPU ``ordinal``); raises NotKept."""
        with self._lock:
            self._check_frees(ordinal)
            key = (ordinal, node_id, ptrs.tobytes(), nbytes.tobytes())
            part = self._parts.get(key)
            if part is not None:
                return part
            table, idx, ok = self._find(ptrs, nbytes, ordinal)
            if not ok.all():
                raise NotKept(int(np.flatnonzero(~ok)[0]))
            used, seg = np.unique(idx, return_inverse=True)
            part = IpcPart(node_id=node_id, sender=self.token, pid=os.getpid(), device_uuid=device_uuid(ordinal),
                           segments=[table.entries[j][:3] for j in used], seg=seg.astype(np.int64),
                           offset=ptrs - table.bases[used][seg], nbytes=nbytes, kept_id=next(self._kept_ids))
            if len(self._parts) >= self.max_parts:
                self._parts.clear()
            self._parts[key] = part
            return part

    def _find(self, ptrs: np.ndarray, nbytes: np.ndarray, ordinal: int) -> Tuple[_KeptTable, np.ndarray, np.ndarray]:
        """GPU ``ordinal``'s table and :meth:`_KeptTable.find` of the tensors in it, rebuilt if some lie outside."""
        table = self._tables.get(ordinal)
        idx, ok = table.find(ptrs, nbytes) if table is not None else (None, np.zeros(len(ptrs), bool))
        if not ok.all():
            table = self._tables[ordinal] = self._build(ordinal, table)
            idx, ok = table.find(ptrs, nbytes)
        return table, idx, ok

    def _check_frees(self, ordinal: int) -> None:
        """Look the table up anew if a registered storage was deregistered or a kept segment was allocated anew."""
        if not all(map(self._still_registered, self._registered.get(ordinal, ()))):
            self._tables.pop(ordinal, None)
            self._parts.clear()
        frees = device_frees(ordinal)
        if self._frees.get(ordinal) != frees:
            self._frees[ordinal] = frees
            table = self._tables.get(ordinal)
            if table is not None:
                with cuda_driver.pushed(cuda_driver.driver(), ordinal) as drv:
                    changed = any(drv.buffer_id(e[0]) != e[3] for e in table.entries)
                if changed:
                    self._tables[ordinal] = self._build(ordinal, table)
                    self._parts.clear()  # their handles may be stale

    def _build(self, ordinal: int, old: Optional[_KeptTable]) -> _KeptTable:
        known = {e[0]: e for e in (old.entries if old is not None else ())}
        segments = {}
        for source in self._sources.get(ordinal, []):
            segments.update(dict(source()))
        with cuda_driver.pushed(cuda_driver.driver(), ordinal) as drv:
            self._registered[ordinal] = {p for p in self._registered.get(ordinal, ()) if self._still_registered(p)}
            for ptr in self._registered[ordinal]:
                base, size = drv.address_range(ptr)
                segments[base] = size
            entries = []
            for base, size in segments.items():
                e = known.get(base)
                bid = drv.buffer_id(base)
                if e is None or e[1] != size or e[3] != bid:
                    e = (base, size, drv.ipc_handle(base), bid)
                entries.append(e)
        return _KeptTable(entries)


@dataclass
class _Mapping:
    handle: bytes
    size: int
    ptr: int
    ordinal: int
    pid: int


class CudaIpcReader:
    """Maps senders' kept segments once and copies their tensors into targets."""

    max_kept_senders = 4

    def __init__(self):
        self.lock = threading.Lock()  # guards the mappings, tables and resolved parts; held over a read
        self.kept: Dict[Tuple[str, int], _Mapping] = {}  # (sender, base) -> mapping
        self._ordinals: Dict[str, Optional[int]] = {}
        self._tables: Dict[int, tuple] = {}  # id(targets ptrs) -> (ptrs, src, device table)
        # id(part) -> (part, (generation, ordinal), addresses here); each closed mapping bumps the generation.
        self._resolved: Dict[int, tuple] = {}
        self._gen = 0
        self._no_kernel: Optional[str] = None
        self._watch: Optional[threading.Thread] = None
        self._writes: Optional[torch.cuda.Event] = None  # recorded after the last writes queued (mapped)

    def ordinal(self, uuid_str: str) -> Optional[int]:
        if uuid_str not in self._ordinals:
            self._ordinals[uuid_str] = local_ordinal_of(uuid_str)
        return self._ordinals[uuid_str]

    def unusable(self, part: IpcPart, device, node_id: str) -> Optional[str]:
        """None when this process can read ``part`` into tensors on ``device``."""
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if node_id != part.node_id:
            return "the sender is on another node"
        if self.ordinal(part.device_uuid) is None:
            return (f"the sender's GPU {part.device_uuid} is not visible here (set "
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 for the receiving actors)")
        if device is None or device.type != "cuda":
            return f"target buffers on {device}"
        return None

    def read(self, part: IpcPart, targets: Targets, device, copy: bool = True) -> ReadResult:
        """Copy ``part``'s tensors into ``targets`` on ``device`` and wait for it (``copy=False``: only map and make
        the kernel table). Raises :class:`MappingFailed`, before any byte moved, when a segment cannot be mapped."""
        t0 = time.perf_counter()
        targets.check(part.nbytes)
        dst_ord = device.index if device.index is not None else torch.cuda.current_device()
        src_ord = self.ordinal(part.device_uuid)
        res = ReadResult("cuda_ipc", len(targets.tensors), int(part.nbytes.sum()), 0.0)
        stream = torch.cuda.current_stream(dst_ord)
        with self.lock, cuda_driver.pushed(cuda_driver.driver(), dst_ord) as drv:
            src = self._sources(drv, part, dst_ord, res, copy)
            if copy and len(targets.tensors):
                t1 = time.perf_counter()
                res.method = self._copy(drv, targets, src, part.nbytes, src_ord, dst_ord)
                stream.synchronize()
                res.copy_seconds = time.perf_counter() - t1
            elif len(targets.tensors) and src_ord == dst_ord:
                kernel = self._kernel(dst_ord)
                if kernel is not None:  # the first read's table
                    self._table(kernel, targets, src, part.nbytes)
                    stream.synchronize()  # (a pull may run on another stream)
        res.seconds = time.perf_counter() - t0
        return res

    @contextlib.contextmanager
    def mapped(self, part: IpcPart, ordinal: int):
        """The addresses here of ``part``'s tensors (kept mapped) to queue writes to; none is closed before they end."""
        res = ReadResult("cuda_ipc", len(part.nbytes), int(part.nbytes.sum()), 0.0)
        with self.lock, cuda_driver.pushed(cuda_driver.driver(), ordinal) as drv:
            yield self._sources(drv, part, ordinal, res, True)
            self._writes = torch.cuda.Event()
            self._writes.record(torch.cuda.current_stream(ordinal))

    def _sources(self, drv, part: IpcPart, ordinal: int, res: ReadResult, copy: bool) -> np.ndarray:
        hit = self._resolved.get(id(part))
        if hit is not None and hit[0] is part and hit[1] == (self._gen, ordinal):
            res.reused += len(part.segments)
            return hit[2]
        src = self._map(drv, part, ordinal, res, touch=not copy)[part.seg] + part.offset
        if len(self._resolved) >= 1024:
            self._resolved.clear()
        self._resolved[id(part)] = (part, (self._gen, ordinal), src)
        return src

    def _map(self, drv, part: IpcPart, ordinal: int, res: ReadResult, touch: bool) -> np.ndarray:
        out = np.zeros(len(part.segments), np.int64)
        opened: List[Tuple[int, int]] = []
        for i, (base, size, handle) in enumerate(part.segments):
            key = (part.sender, base)
            m = self.kept.get(key)
            if m is not None and (m.handle != handle or m.size != size or m.ordinal != ordinal):
                self._close(drv, self.kept.pop(key).ptr)  # freed and allocated anew
                self._gen += 1
                m = None
            if m is None:
                try:
                    ptr = drv.ipc_open(handle)
                except CudaDriverError as e:
                    raise MappingFailed(f"cuIpcOpenMemHandle: {e}") from e
                m = self.kept[key] = _Mapping(handle, size, ptr, ordinal, part.pid)
                opened.append((ptr, size))
                res.opened += 1
            else:
                res.reused += 1
            out[i] = m.ptr
        senders = list(dict.fromkeys(s for s, _ in self.kept))  # oldest first: evict those beyond max_kept_senders
        for sender in senders[: max(0, len(senders) - self.max_kept_senders)]:
            if sender != part.sender:
                self._release_locked(lambda key, m, s=sender: key[0] == s)
        if opened:
            if self._watch is None:
                self._watch = threading.Thread(target=_watch_senders, args=(weakref.ref(self),),
                                               name="rdt-ipc-watch", daemon=True)
                self._watch.start()
            if touch:
                self._touch(opened, ordinal)
        return out

    def _touch(self, mappings: List[Tuple[int, int]], ordinal: int) -> None:
        """Read newly mapped segments once, so that the first copy does not pay for touching them first."""
        kernel = self._kernel(ordinal)
        if kernel is None:
            return
        try:
            scratch = torch.empty(cuda_driver.CHUNK_BYTES, dtype=torch.uint8, device=torch.device("cuda", ordinal))
            src, n = np.array(mappings, np.int64).T  # (address, size) rows
            table = kernel.table(np.full(len(src), scratch.data_ptr(), np.int64), src, n, same_dst=True)
            stream = torch.cuda.current_stream(ordinal)
            kernel.launch(table.data_ptr(), table.numel() // 3, stream.cuda_stream)
            stream.synchronize()
        except Exception as e:  # a warm-up: the mapping itself is done
            logger.debug("[RDT] reading kept segments ahead of use failed: %s", e)

    def _copy(self, drv, targets: Targets, src: np.ndarray, nbytes: np.ndarray, src_ord: int, dst_ord: int) -> str:
        stream = torch.cuda.current_stream(dst_ord).cuda_stream
        kernel = self._kernel(dst_ord) if src_ord == dst_ord else None
        if kernel is not None:
            table = self._table(kernel, targets, src, nbytes)
            kernel.launch(table.data_ptr(), table.numel() // 3, stream)
            return "kernel"
        if src_ord != dst_ord:
            try:
                cuda_driver.memcpy_batch(drv, targets.ptrs, src, nbytes, stream, src_ord, dst_ord)
                return "batch"
            except CudaDriverError as e:  # refused before anything was queued
                logger.debug("[RDT] cuMemcpyBatchAsync refused (%s): one call per tensor", e)
        for d, s, n in zip(targets.ptrs.tolist(), src.tolist(), nbytes.tolist()):
            drv.memcpy_async(d, s, n, stream)
        return "ce"

    def _kernel(self, ordinal: int):
        """The SM copy kernel on GPU ``ordinal``, or None when it cannot be built (logged once)."""
        if self._no_kernel is not None:
            return None
        try:
            return cuda_driver.copy_kernel(ordinal)
        except (OSError, CudaDriverError) as e:
            self._no_kernel = str(e)
            logger.warning("[RDT] no SM copy kernel (%s): one copy-engine call per tensor", e)
            return None

    def _table(self, kernel, targets: Targets, src: np.ndarray, nbytes: np.ndarray):
        """The kernel's device table, reused while these targets' sources stay the same."""
        cached = self._tables.get(id(targets.ptrs))
        if cached is not None and cached[0] is targets.ptrs and np.array_equal(cached[1], src):
            return cached[2]
        table = kernel.table(targets.ptrs, src, nbytes)
        if len(self._tables) >= 64:
            self._tables.clear()
        self._tables[id(targets.ptrs)] = (targets.ptrs, src, table)
        return table

    def _close(self, drv, ptr: int) -> None:
        if self._writes is not None:
            self._writes.synchronize()  # (queued writes into it)
        try:
            drv.ipc_close(ptr)
        except CudaDriverError as e:  # pragma: no cover - best effort
            logger.warning("[RDT] closing a CUDA IPC mapping failed: %s", e)

    def release(self, sender: Optional[str] = None, gone_only: bool = False) -> int:
        """Close ``sender``'s kept mappings (None: all; ``gone_only``: of exited processes); returns how many."""
        if not self.kept:
            return 0
        alive: Dict[int, bool] = {}  # one look per sender process

        def match(key, m) -> bool:
            if sender is not None and key[0] != sender:
                return False
            if gone_only and m.pid not in alive:
                alive[m.pid] = pid_alive(m.pid)
            return not gone_only or not alive[m.pid]

        with self.lock:
            return self._release_locked(match)

    def _release_locked(self, match) -> int:
        keys = [k for k, m in self.kept.items() if match(k, m)]
        if not keys:
            return 0
        drv = cuda_driver.driver()
        by_ordinal: Dict[int, List[int]] = {}
        for m in map(self.kept.pop, keys):
            by_ordinal.setdefault(m.ordinal, []).append(m.ptr)
        for ordinal, ptrs in by_ordinal.items():
            with cuda_driver.pushed(drv, ordinal):
                for ptr in ptrs:
                    self._close(drv, ptr)
        self._tables.clear()  # a table may point into a closed mapping
        self._resolved.clear()
        self._gen += 1
        return len(keys)

    def stats(self) -> Dict[str, int]:
        with self.lock:
            return {"kept_mappings": len(self.kept), "kept_bytes": sum(m.size for m in self.kept.values()),
                    "kept_senders": len({s for s, _ in self.kept})}


def _watch_senders(reader_ref) -> None:
    """Close mappings of exited senders (their memory stays allocated while mapped) while the reader lives."""
    while True:
        time.sleep(WATCH_S)
        reader = reader_ref()
        if reader is None:
            return
        try:
            n = reader.release(gone_only=True)
            if n:
                logger.info("[RDT] closed %d kept CUDA IPC mappings of exited senders", n)
        except Exception as e:  # pragma: no cover - the next look tries again
            logger.warning("[RDT] closing mappings of exited senders failed: %s", e)
        del reader
