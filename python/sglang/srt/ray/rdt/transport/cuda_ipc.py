"""The CUDA IPC path of ``SGLANG_IPC``: GPU tensors between processes of one node.

The sender exports CUDA IPC handles of the cudaMalloc segments that hold its
tensors (:meth:`CudaIpcPath.export`); a receiver on the same Ray node that
sees the sender's GPU maps those segments (:mod:`.mapping_cache`) and copies
with the copy engine straight into its target buffers.

Traps this avoids (shared/DESIGN.md section 3): no inter-process CUDA event is
waited on from another GPU's stream (that segfaulted): the sender synchronises
its device when it creates the ref, and the receiver synchronises its copy
streams on the host. The sender never caches handles: every put asks the
driver for the handle of the segment as it is now.

Tuning (sglang's ``envs``, read when the path is created): ``SGLANG_RDT_IPC_METHOD``
(``batch``: one ``cuMemcpyBatchAsync`` per stream, default, falls back to
``ce`` if the driver refuses; ``ce``: one ``cuMemcpyAsync`` per tensor;
``kernel``: one SM copy kernel, experimental, needs CuPy),
``SGLANG_RDT_IPC_STREAMS`` (copy streams, default 1), ``SGLANG_RDT_IPC_ENGINE``
(``dst``: the receiving GPU reads over NVLink, default; ``src``: the source GPU
writes, which costs a CUDA context on the source GPU in the receiving process).

Sender and receiver on the same GPU (a colocated trainer and engine): the copy
is an on-device copy, and one ``cuMemcpyAsync`` per tensor spread over
``SGLANG_RDT_IPC_SAME_GPU_STREAMS`` streams (default 4) beats one batched copy
(H200, 8 GiB: batch 1.32 TB/s, one stream 1.33, two 1.52-1.63, four 1.50-1.65
in the transport; 2.0 TB/s for four streams in one process, against 1.91 for
one 8 GiB copy; docs/performance.md). ``SGLANG_RDT_IPC_SAME_GPU_METHOD``
(default ``ce``) picks the method there.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Dict, List, Optional, Tuple

from sglang.srt.ray.rdt.transport import cuda_driver
from sglang.srt.ray.rdt.transport.copy_plan import plan_copies, spread
from sglang.srt.ray.rdt.transport.cuda_driver import (
    CudaDriverError,
    device_uuid,
    launch_batch,
    local_ordinal_of,
    prepare_batch,
    sm_copy,
)
from sglang.srt.ray.rdt.transport.mapping_cache import CopyPlan, MappingCache
from sglang.srt.ray.rdt.transport.metadata import FetchInfo, IpcPart, SglangIpcTransportMetadata
from sglang.srt.ray.rdt.transport.persistent import all_persistent

logger = logging.getLogger(__name__)


class CudaIpcPath:
    max_exports = 4096  # segments whose handles a sender keeps
    def __init__(self, token: str):
        self.token = token  # this process's sender identity
        self.cache = MappingCache()
        from sglang.srt.environ import envs

        self.nstreams = envs.SGLANG_RDT_IPC_STREAMS.get()
        self.engine = envs.SGLANG_RDT_IPC_ENGINE.get()
        self.method = envs.SGLANG_RDT_IPC_METHOD.get()
        # same GPU on both sides: an on-device copy (see the module docstring)
        self.same_gpu_method = envs.SGLANG_RDT_IPC_SAME_GPU_METHOD.get()
        self.same_gpu_streams = envs.SGLANG_RDT_IPC_SAME_GPU_STREAMS.get()
        self._streams: Dict[Tuple[int, int], list] = {}
        # sender: per GPU, segment base -> (size, allocation id, IPC handle)
        self._exports: Dict[int, Dict[int, Tuple[int, Optional[int], bytes]]] = {}
        self._export_starts: Dict[int, List[int]] = {}
        self._ordinals: Dict[str, Optional[int]] = {}

    def ordinal(self, uuid_str: str) -> Optional[int]:
        """This process's index of the GPU ``uuid_str`` (None: not visible)."""
        if uuid_str not in self._ordinals:
            self._ordinals[uuid_str] = local_ordinal_of(uuid_str)
        return self._ordinals[uuid_str]

    # -- sender ------------------------------------------------------------ #
    def export(self, tensors, ordinal: int, node_id: str, persistent: bool = False) -> IpcPart:
        """IPC handles of the segments holding ``tensors`` (all on GPU ``ordinal``);
        ``persistent``: the owner declares them kept across updates.

        A segment's handle is asked of the driver once and kept with the
        segment's allocation id (``cuPointerGetAttribute(BUFFER_ID)``, unique
        per allocation in this process); every put checks that id again, so a
        segment freed and allocated anew (same address, a new allocation) gets
        a new handle. One driver call per segment per put instead of two
        (range + handle: ~4 ms for 256 segments on an H200 host).
        """
        drv = cuda_driver.driver()
        segments: List[Tuple[int, int, bytes]] = []
        index: Dict[int, int] = {}
        per_tensor = []
        known = self._exports.setdefault(ordinal, {})
        starts = self._export_starts.get(ordinal) or []
        checked: Dict[int, bool] = {}  # segment base -> still the allocation we know
        drv.push(ordinal)
        try:
            for t in tensors:
                ptr = t.data_ptr()
                nbytes = t.numel() * t.element_size()
                seg = None
                i = bisect.bisect_right(starts, ptr) - 1
                if i >= 0:
                    base = starts[i]
                    size, bid, handle = known[base]
                    if ptr + nbytes <= base + size:
                        ok = checked.get(base)
                        if ok is None:
                            ok = checked[base] = drv.buffer_id(base) == bid
                        if ok:
                            seg = index.get(base)
                            if seg is None:
                                seg = index[base] = len(segments)
                                segments.append((base, size, handle))
                if seg is None:
                    base, size = drv.address_range(ptr)
                    seg = index.get(base)
                    if seg is None:
                        handle = drv.ipc_handle(base)
                        known[base] = (size, drv.buffer_id(base), handle)
                        checked[base] = True
                        seg = index[base] = len(segments)
                        segments.append((base, size, handle))
                        # drop known segments this one overlaps (freed since)
                        for b in [b for b in known if b != base and b < base + size
                                  and base < b + known[b][0]]:
                            del known[b]
                        starts = self._export_starts[ordinal] = sorted(known)
                per_tensor.append((seg, ptr - segments[seg][0], nbytes))
            if len(known) > self.max_exports:
                known.clear()
                self._export_starts[ordinal] = []
        finally:
            drv.pop()
        return IpcPart(
            node_id=node_id, sender=self.token, pid=os.getpid(),
            device_uuid=device_uuid(ordinal), segments=segments, tensors=per_tensor,
            persistent=persistent or all_persistent(ordinal, segments),
        )

    # -- receiver ---------------------------------------------------------- #
    def unusable(self, meta: SglangIpcTransportMetadata, targets, node_id: str) -> Optional[str]:
        """None when this process can read ``meta`` over CUDA IPC, else why not."""
        import torch

        if meta.ipc is None:
            return meta.ipc_unavailable or "the sender put no CUDA IPC handles"
        if not torch.cuda.is_available():
            return "no CUDA device in this process"
        if node_id != meta.ipc.node_id:
            return "the sender is on another node"
        if self.ordinal(meta.ipc.device_uuid) is None:
            return (
                f"the sender's GPU {meta.ipc.device_uuid} is not visible here (set "
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 for the receiving actors)"
            )
        if targets:
            devs = {t.device for t in targets}
            if len(devs) != 1 or next(iter(devs)).type != "cuda":
                return f"target buffers on {sorted(map(str, devs))}"
        return None

    def copy_config(self, src_ord: int, dst_ord: int) -> Tuple[str, int]:
        """(method, streams) of a copy from GPU ``src_ord`` into ``dst_ord``."""
        if src_ord == dst_ord:
            return self.same_gpu_method, self.same_gpu_streams
        return self.method, self.nstreams

    def _streams_for(self, ordinal: int, n: int) -> list:
        import torch

        n = max(1, n)
        streams = self._streams.get((ordinal, n))
        if streams is None:
            streams = self._streams[(ordinal, n)] = [
                torch.cuda.Stream(device=ordinal) for _ in range(n)
            ]
        return streams

    def receive(self, meta: SglangIpcTransportMetadata, targets, info: FetchInfo, copy: bool = True,
                while_copying=None):
        """Copy ``meta``'s tensors into ``targets``; ``copy=False``: only map
        the sender's segments and plan the copies (kept for the next fetch).
        ``while_copying(True)`` runs once the copies are launched (bytes are
        being written), while the copy engine works; what it raises is raised
        after the copies finished."""
        import torch

        ipc = meta.ipc
        if targets:
            tensors = list(targets)
        else:
            dev = torch.device("cuda", torch.cuda.current_device())
            tensors = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in meta.tensor_meta]
        if len(tensors) != len(ipc.tensors):
            raise ValueError(
                f"Length of tensor_buffers ({len(tensors)}) does not match length from "
                f"object metadata ({len(ipc.tensors)})."
            )
        dst_ptrs = [t.data_ptr() for t in tensors]
        dst_ord = tensors[0].device.index
        src_ord = self.ordinal(ipc.device_uuid)
        engine_ord = src_ord if self.engine == "src" else dst_ord
        method, nstreams = self.copy_config(src_ord, dst_ord)
        info.tensors, info.bytes = len(tensors), sum(n for _, _, n in ipc.tensors)
        info.engine = self.engine
        key = (ipc.sender, engine_ord, dst_ord, src_ord, method, nstreams,
               dst_ptrs[0] if dst_ptrs else 0, len(dst_ptrs))
        cache = self.cache
        with cache.lock:
            cache.fetches += 1
            t0 = time.perf_counter()
            plan = cache.plan(key, dst_ptrs, ipc)
            if plan is None:
                plan = self._new_plan(key, ipc, tensors, dst_ptrs, bool(targets),
                                      (src_ord, dst_ord, engine_ord), (method, nstreams), info)
                info.plan = "new"
            else:
                # The same tensors from the same sender segments into the same
                # targets, and no mapping closed since: reuse the plan.
                info.reused = len(plan.mappings)
                info.plan = "reused"
            info.open_seconds = time.perf_counter() - t0
            info.copies, info.streams, info.method = plan.copies, len(plan.queues), method
            if copy:
                t1 = time.perf_counter()
                self._launch(plan, engine_ord, dst_ord, method, info)
                cache.used(plan, ipc.sender)  # bookkeeping while the copy engine works
                failed = None
                if while_copying is not None:
                    try:
                        while_copying(True)
                    except BaseException as e:  # raised once no copy is in flight
                        failed = e
                for s in plan.streams:
                    s.synchronize()  # host-side: no cross-GPU event wait
                info.copy_seconds = time.perf_counter() - t1
                if failed is not None:
                    raise failed
            else:
                cache.used(plan, ipc.sender)
            if not cache.enabled:
                cache.close_pending()
        return tensors

    def _new_plan(self, key, ipc: IpcPart, tensors, dst_ptrs, given_targets: bool,
                  ordinals, config, info: FetchInfo) -> CopyPlan:
        """Check the targets, map the segments and plan the copies."""
        src_ord, dst_ord, engine_ord = ordinals
        method, nstreams = config
        for i, (t, (_, _, nbytes)) in enumerate(zip(tensors, ipc.tensors)):
            # Ray checked given targets for contiguity already.
            if t.nbytes != nbytes or (not given_targets and not t.is_contiguous()):
                raise ValueError(f"target buffer {i} is not a contiguous buffer of {nbytes} bytes")
        if engine_ord != dst_ord:
            cuda_driver.driver().enable_peer_access(engine_ord, dst_ord)
        mapped = self.cache.map_segments(ipc, engine_ord, info)
        copies = plan_copies(
            [(d, mapped[seg] + off, n) for d, (seg, off, n) in zip(dst_ptrs, ipc.tensors)]
        )
        streams = self._streams_for(engine_ord, nstreams)
        queues = spread(copies, len(streams))
        plan = CopyPlan(
            key=key, generation=self.cache.generation, dst_ptrs=dst_ptrs,
            segments=ipc.segments, tensors=ipc.tensors, copies=len(copies),
            queues=queues, streams=streams[: len(queues)],
            batch=[prepare_batch(q, src_ord, dst_ord) for q in queues]
            if method == "batch" else None,
            mappings=[self.cache.mappings[(ipc.sender, base)] for base, _, _ in ipc.segments],
        )
        self.cache.keep_plan(key, plan)
        return plan

    def _launch(self, plan: CopyPlan, engine_ord: int, dst_ord: int, method: str,
                info: FetchInfo) -> None:
        import torch

        drv = cuda_driver.driver()
        # The copies start after what the receiver already queued on its
        # device (same-process events: safe even across GPUs).
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dst_ord))
        drv.push(engine_ord)
        try:
            for i, (q, s) in enumerate(zip(plan.queues, plan.streams)):
                s.wait_event(ready)
                h = s.cuda_stream
                if method == "kernel":
                    sm_copy(q, engine_ord, h)
                    continue
                if method == "batch" and plan.batch is not None:
                    try:
                        launch_batch(drv, plan.batch[i], h)
                        continue
                    except CudaDriverError as e:
                        # Refused before anything was queued; copies are idempotent.
                        logger.warning("[RDT] cuMemcpyBatchAsync refused (%s): one copy per "
                                       "tensor from now on", e)
                        self.method = info.method = "ce"
                        if self.same_gpu_method == "batch":
                            self.same_gpu_method = "ce"
                        self.cache.plans.clear()
                for dst, src, n in q:
                    drv.memcpy_async(dst, src, n, h)
        finally:
            drv.pop()
