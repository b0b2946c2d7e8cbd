"""GPU tensors between processes of one node: CUDA IPC handles and one copy.

The sender describes its tensors by the cudaMalloc segments that hold them
(:class:`CudaIpcExporter`); a segment's handle is asked of the driver once and
kept with the segment's allocation id (a segment freed and allocated anew
gets a new id, hence a new handle). A reader on the same node that sees the
sender's GPU maps those segments and copies the tensors into its targets
(:class:`CudaIpcReader`): on one GPU with one SM kernel over all tensors,
between two GPUs with one batched copy-engine call.

CUDA forbids a process to free memory another process still has mapped, so a
reader closes the mappings of a read once the copy is done, unless the
segment is *kept* (the trainer's staging pool, ``trainer/staging.py``): kept
segments stay mapped until their sender asks readers to let go
(:meth:`CudaIpcReader.release`) or its process is gone. The sender
synchronises its device before its tensors are read; the reader synchronises
its copy on the host, unless the read is *fenced*: then the copy of kept
segments is left running, the reader records its inter-process event
(:meth:`CudaIpcReader.fence`) after it, and the sender waits on that event
before it lets go of its tensors, while the reader finishes its own work
(:meth:`CudaIpcReader.settle` waits for the copy on this side; nothing is
closed or read again before it).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang.srt.ray.rdt.transport import cuda_driver
from sglang.srt.ray.rdt.transport.cma import pid_alive
from sglang.srt.ray.rdt.transport.cuda_driver import CudaDriverError, device_uuid, local_ordinal_of
from sglang.srt.ray.rdt.transport.metadata import IpcPart, MappingFailed, ReadResult, Targets

logger = logging.getLogger(__name__)


class _KnownSegments:
    """The segments of one GPU this process has exported, sorted by base:
    ``(base, size, allocation id, handle, kept)`` each."""

    def __init__(self):
        self.bases = np.zeros(0, np.int64)
        self.ends = np.zeros(0, np.int64)
        self.entries: List[Tuple[int, int, Optional[int], bytes, bool]] = []

    def find(self, ptrs: np.ndarray, nbytes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.searchsorted(self.bases, ptrs, side="right") - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if len(self.ends):
            ok &= ptrs + nbytes <= self.ends[safe]
        else:
            ok[:] = False
        return safe, ok

    def replace(self, drop, add) -> None:
        dropped = set(drop)
        keep = [e for i, e in enumerate(self.entries) if i not in dropped]
        for new in add:  # a new segment replaces what it overlaps (freed since)
            keep = [e for e in keep if e[0] + e[1] <= new[0] or new[0] + new[1] <= e[0]]
            keep.append(new)
        keep.sort(key=lambda e: e[0])
        self.entries = keep
        self.bases = np.array([e[0] for e in keep], np.int64)
        self.ends = np.array([e[0] + e[1] for e in keep], np.int64)


class CudaIpcExporter:
    """IPC handles of the segments holding a sender's tensors (see the module docstring).

    ``keeper(ordinal)`` gives, per GPU, the function that says whether a
    segment base is kept memory (the trainer's staging pool) or None; asked
    once per segment, when the segment is first seen.
    """

    max_known = 4096  # segments kept per GPU before the memo starts over
    max_parts = 1024  # descriptions of kept memory remembered (a model's groups)

    def __init__(self, token: str, keeper: Callable[[int], Optional[Callable[[int], bool]]]):
        self.token = token
        self._keeper = keeper
        self._known: Dict[int, _KnownSegments] = {}
        # (ordinal, addresses, sizes) -> the IpcPart of tensors wholly in kept
        # segments: kept memory is not freed while kept, so tensors made anew
        # at the same addresses (the staging pool's allocator hands them out
        # again) are described without looking at a segment.
        self._parts: Dict[tuple, IpcPart] = {}
        self._kept_epoch = 0  # bumped when kept memory is withdrawn
        self._kept_ids = itertools.count(1)
        self._lock = threading.Lock()  # guards the known segments and the parts

    def export(self, ptrs: np.ndarray, nbytes: np.ndarray, ordinal: int, node_id: str,
               check=None) -> IpcPart:
        """An :class:`IpcPart` of the tensors at ``ptrs`` of ``nbytes`` each
        (contiguous, all on GPU ``ordinal``; ``check()``: raises unless they
        are, asked unless the tensors sit wholly in kept memory of ``ordinal``
        as a remembered description says: in one address space an address
        belongs to one allocation, hence one device)."""
        key = (ordinal, node_id, ptrs.tobytes(), nbytes.tobytes())
        part = self._parts.get(key)
        if part is not None:
            return part
        if check is not None:
            check()
        epoch = self._kept_epoch
        part = self._export(ptrs, nbytes, ordinal, node_id)
        if all(s[3] for s in part.segments):
            with self._lock:
                if epoch != self._kept_epoch:  # withdrawn meanwhile: not to be reused
                    return part
                if len(self._parts) >= self.max_parts:
                    self._parts.clear()
                part.kept_id = next(self._kept_ids)
                self._parts[key] = part
        return part

    def _export(self, ptrs, nbytes, ordinal: int, node_id: str) -> IpcPart:
        drv = cuda_driver.driver()
        with self._lock:
            known = self._known.setdefault(ordinal, _KnownSegments())
            drv.push(ordinal)
            try:
                idx, used = self._resolve(drv, known, ptrs, nbytes, self._keeper(ordinal))
            finally:
                drv.pop()
            entries = [known.entries[j] for j in used]
            if len(known.entries) > self.max_known:
                self._known[ordinal] = _KnownSegments()
        seg = np.searchsorted(used, idx)
        bases = np.array([e[0] for e in entries], np.int64)
        return IpcPart(
            node_id=node_id, sender=self.token, pid=os.getpid(), device_uuid=device_uuid(ordinal),
            segments=[(e[0], e[1], e[3], e[4]) for e in entries],
            seg=seg.astype(np.int64), offset=ptrs - bases[seg], nbytes=nbytes,
        )

    def forget_kept(self, ordinal: int) -> None:
        """The kept memory of GPU ``ordinal`` is being freed: look its segments up anew."""
        with self._lock:
            self._kept_epoch += 1
            self._parts.clear()
            known = self._known.get(ordinal)
            if known is not None:
                known.replace([i for i, e in enumerate(known.entries) if e[4]], [])

    @staticmethod
    def _resolve(drv, known: _KnownSegments, ptrs, nbytes, kept):
        """Each tensor's index into ``known`` and the sorted indices used;
        segments not known (or freed and allocated again) are asked of the
        driver. Kept segments are not checked again (they cannot be freed
        while kept)."""
        for _ in range(3):
            idx, ok = known.find(ptrs, nbytes)
            add, seen = [], set()
            for i in np.nonzero(~ok)[0]:
                base, size = drv.address_range(int(ptrs[i]))
                if base not in seen:
                    seen.add(base)
                    add.append((base, size, drv.buffer_id(base), drv.ipc_handle(base),
                                bool(kept(base)) if kept is not None else False))
            if add:
                known.replace([], add)
                continue
            used = np.unique(idx)
            stale = [int(j) for j in used if not known.entries[j][4]
                     and drv.buffer_id(known.entries[j][0]) != known.entries[j][2]]
            if not stale:
                return idx, used
            known.replace(stale, [])
        raise CudaDriverError("cuMemGetAddressRange", -1, "the tensors' segments keep changing")


@dataclass
class _Mapping:
    handle: bytes
    size: int
    ptr: int
    ordinal: int
    pid: int


class CudaIpcReader:
    """Maps senders' segments and copies their tensors into targets."""

    max_kept_senders = 4

    def __init__(self):
        self.lock = threading.Lock()  # guards the mappings, tables and resolved parts; held over a read
        self.kept: Dict[Tuple[str, int], _Mapping] = {}  # (sender, base) -> mapping
        self._ordinals: Dict[str, Optional[int]] = {}
        self._tables: Dict[int, tuple] = {}  # id(targets ptrs) -> (ptrs, src, device table)
        # id(part) -> (part, (kept generation, ordinal), its tensors' addresses here): a
        # description of kept memory read again (a lane names it) is not looked at again
        # while none of the kept mappings closed (each close bumps the generation).
        self._resolved: Dict[int, tuple] = {}
        self._kept_gen = 0
        self._no_kernel: Optional[str] = None
        self._fences: Dict[int, torch.cuda.Event] = {}  # ordinal -> this reader's event
        self._unsettled: Optional[torch.cuda.Event] = None  # a fenced copy not yet waited for here

    def fence(self, ordinal: int) -> torch.cuda.Event:
        """The inter-process event a fenced read on GPU ``ordinal`` records
        after its copy (made once; a sender opens it from its IPC handle)."""
        with self.lock:
            return self._fence_locked(ordinal)

    def _fence_locked(self, ordinal: int) -> torch.cuda.Event:
        ev = self._fences.get(ordinal)
        if ev is None:
            with torch.cuda.device(ordinal):
                ev = torch.cuda.Event(interprocess=True)
                ev.record(torch.cuda.current_stream(ordinal))  # (created on this device now)
            self._fences[ordinal] = ev
        return ev

    def settle(self) -> None:
        """Wait for a fenced copy still running."""
        with self.lock:
            self._settle_locked()

    def _settle_locked(self) -> None:
        ev, self._unsettled = self._unsettled, None
        if ev is not None:
            ev.synchronize()

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

    def read(self, part: IpcPart, targets: Targets, device, copy: bool = True,
             fence: bool = False) -> ReadResult:
        """Copy ``part``'s tensors into ``targets`` (all on ``device``).
        ``copy=False``: map the kept segments only (and make the copy's kernel
        table of a description wholly in kept memory). ``fence``: when every
        segment is kept, return once the copy is queued, with this reader's
        event recorded after it (``res.fenced``; see the module docstring).
        Raises :class:`MappingFailed` before any byte moved when a segment
        cannot be mapped (another reader, e.g. NIXL, may still serve the read)."""
        t0 = time.perf_counter()
        targets.check(part.nbytes)
        dst_ord = device.index if device.index is not None else torch.cuda.current_device()
        src_ord = self.ordinal(part.device_uuid)
        res = ReadResult("cuda_ipc", len(targets.tensors), int(part.nbytes.sum()), 0.0)
        transient: List[int] = []
        stream = torch.cuda.current_stream(dst_ord)
        with self.lock:
            drv = cuda_driver.driver()
            drv.push(dst_ord)
            launched = False
            try:
                self._settle_locked()
                src = self._sources(drv, part, dst_ord, res, transient, copy)
                if copy and len(targets.tensors):
                    t1 = time.perf_counter()
                    launched = True
                    res.method = self._copy(drv, targets, src, part.nbytes, src_ord, dst_ord)
                    if fence and not transient:
                        ev = self._fence_locked(dst_ord)
                        ev.record(stream)
                        self._unsettled, res.fenced = ev, True
                    else:
                        stream.synchronize()
                    launched = False
                    res.copy_seconds = time.perf_counter() - t1
                elif len(targets.tensors) and part.kept_id and src_ord == dst_ord:
                    kernel = self._kernel(dst_ord)
                    if kernel is not None:  # the first read's table, made now
                        self._table(kernel, targets, src, part.nbytes)
                        stream.synchronize()  # (a pull may run on another stream)
            finally:
                if launched:  # a copy may still read the mappings: let it end first
                    try:
                        stream.synchronize()
                    except Exception:  # pragma: no cover - the CUDA error is raised already
                        pass
                for ptr in transient:  # after the copy: the sender may free it now
                    self._close(drv, ptr)
                res.closed = len(transient)
                drv.pop()
        res.seconds = time.perf_counter() - t0
        return res

    def map_kept(self, part: IpcPart, device) -> int:
        """Map ``part``'s kept segments now (before any read needs them);
        returns how many were opened."""
        ordinal = device.index if device.index is not None else 0
        res = ReadResult("cuda_ipc", 0, 0, 0.0)
        with self.lock:
            drv = cuda_driver.driver()
            drv.push(ordinal)
            try:
                self._map(drv, part, ordinal, res, [], copy=False)
            finally:
                drv.pop()
        return res.opened

    def _sources(self, drv, part: IpcPart, ordinal: int, res: ReadResult, transient: List[int],
                 copy: bool) -> np.ndarray:
        """Where ``part``'s tensors are in this process, mapping what is not mapped."""
        hit = self._resolved.get(id(part))
        if hit is not None and hit[0] is part and hit[1] == (self._kept_gen, ordinal):
            res.reused += len(part.segments)
            return hit[2]
        src = self._map(drv, part, ordinal, res, transient, copy)[part.seg] + part.offset
        if part.kept_id and not transient:  # every segment is kept: mapped now, and stays
            if len(self._resolved) >= 1024:
                self._resolved.clear()
            self._resolved[id(part)] = (part, (self._kept_gen, ordinal), src)
        return src

    def _map(self, drv, part: IpcPart, ordinal: int, res: ReadResult, transient: List[int],
             copy: bool) -> np.ndarray:
        out = np.zeros(len(part.segments), np.int64)
        ahead: List[Tuple[int, int]] = []  # kept segments mapped before any read needs them
        for i, (base, size, handle, keep) in enumerate(part.segments):
            key = (part.sender, base)
            m = self.kept.get(key)
            if m is not None and (m.handle != handle or m.size != size or m.ordinal != ordinal):
                self._close(drv, self.kept.pop(key).ptr)  # freed and allocated anew
                self._kept_gen += 1
                m = None
            if m is None:
                if not (keep or copy):
                    continue  # a prepare maps only what stays mapped
                try:
                    ptr = drv.ipc_open(handle)
                except CudaDriverError as e:
                    for p in transient:
                        self._close(drv, p)
                    transient.clear()
                    raise MappingFailed(f"cuIpcOpenMemHandle: {e}") from e
                res.opened += 1
                if keep:
                    m = self.kept[key] = _Mapping(handle, size, ptr, ordinal, part.pid)
                    if not copy:
                        ahead.append((ptr, size))
                else:
                    transient.append(ptr)
                    out[i] = ptr
                    continue
            else:
                res.reused += 1
            out[i] = m.ptr
        if len({s for s, _ in self.kept}) > self.max_kept_senders:
            self._evict_oldest(drv, part.sender)
        if ahead:
            self._touch(ahead, ordinal)
        return out

    def _touch(self, mappings: List[Tuple[int, int]], ordinal: int) -> None:
        """Read kept segments mapped ahead of use once (into a scratch chunk):
        the first update's copy otherwise pays for the first touch of its
        source pages (the first copy ran 1.3-1.6x a later one)."""
        kernel = self._kernel(ordinal)
        if kernel is None:  # (said once by _kernel)
            return
        try:
            device = torch.device("cuda", ordinal)
            scratch = torch.empty(cuda_driver.CHUNK_BYTES, dtype=torch.uint8, device=device)
            src = np.array([p for p, _ in mappings], np.int64)
            n = np.array([size for _, size in mappings], np.int64)
            dst = np.full(len(src), scratch.data_ptr(), np.int64)
            table = kernel.table(dst, src, n, same_dst=True)  # every chunk lands on the scratch chunk
            stream = torch.cuda.current_stream(ordinal)
            kernel.launch(table.data_ptr(), table.numel() // 3, stream.cuda_stream)
            stream.synchronize()
        except Exception as e:  # a warm-up: the mapping itself is done
            logger.debug("[RDT] reading kept segments ahead of use failed: %s", e)

    def _copy(self, drv, targets: Targets, src: np.ndarray, nbytes: np.ndarray,
              src_ord: int, dst_ord: int) -> str:
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
        """The SM copy kernel on GPU ``ordinal``, or None (it could not be
        built: said once; copies then go through the copy engine)."""
        if self._no_kernel is not None:
            return None
        try:
            return cuda_driver.copy_kernel(ordinal)
        except (OSError, CudaDriverError) as e:
            self._no_kernel = str(e)
            logger.warning("[RDT] no SM copy kernel (%s): one copy-engine call per tensor", e)
            return None

    def _table(self, kernel, targets: Targets, src: np.ndarray, nbytes: np.ndarray):
        """The kernel's device table; the last one of these targets is reused
        when the sources are the same (a kept segment, the same offsets)."""
        cached = self._tables.get(id(targets.ptrs))
        if cached is not None and cached[0] is targets.ptrs and np.array_equal(cached[1], src):
            return cached[2]
        table = kernel.table(targets.ptrs, src, nbytes)
        if len(self._tables) >= 64:
            self._tables.clear()
        self._tables[id(targets.ptrs)] = (targets.ptrs, src, table)
        return table

    def _close(self, drv, ptr: int) -> None:
        self._settle_locked()  # (a fenced copy may still read it)
        try:
            drv.ipc_close(ptr)
        except CudaDriverError as e:  # pragma: no cover - best effort
            logger.warning("[RDT] closing a CUDA IPC mapping failed: %s", e)

    def _evict_oldest(self, drv, current: str) -> None:
        senders = list(dict.fromkeys(s for s, _ in self.kept))
        for sender in senders[: len(senders) - self.max_kept_senders]:
            if sender != current:
                self._release_locked(drv, lambda key, m, s=sender: key[0] == s)

    def release(self, sender: Optional[str] = None, gone_only: bool = False) -> int:
        """Close the kept mappings of ``sender`` (every sender: None;
        ``gone_only``: only those of sender processes that exited)."""
        if not self.kept:
            return 0

        alive: Dict[int, bool] = {}  # one look per sender process

        def match(key, m) -> bool:
            if sender is not None and key[0] != sender:
                return False
            if not gone_only:
                return True
            if m.pid not in alive:
                alive[m.pid] = pid_alive(m.pid)
            return not alive[m.pid]

        with self.lock:
            drv = cuda_driver.driver()
            return self._release_locked(drv, match)

    def _release_locked(self, drv, match) -> int:
        keys = [k for k, m in self.kept.items() if match(k, m)]
        if not keys:
            return 0
        by_ordinal: Dict[int, List[int]] = {}
        for k in keys:
            m = self.kept.pop(k)
            by_ordinal.setdefault(m.ordinal, []).append(m.ptr)
        for ordinal, ptrs in by_ordinal.items():
            drv.push(ordinal)
            try:
                for ptr in ptrs:
                    self._close(drv, ptr)
            finally:
                drv.pop()
        self._tables.clear()  # a table may point into a closed mapping
        self._resolved.clear()
        self._kept_gen += 1
        return len(keys)

    def stats(self) -> Dict[str, int]:
        with self.lock:
            return {"kept_mappings": len(self.kept),
                    "kept_bytes": sum(m.size for m in self.kept.values()),
                    "kept_senders": len({s for s, _ in self.kept})}

