"""Same-node reads: this process's sender identity (:func:`token`), its one exporter and its one reader, over
:mod:`.cuda_ipc` (kept GPU memory) and :mod:`.cma` (host memory)."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Dict, Optional

import numpy as np
import torch

from sglang.srt.ray.rdt.transport import compat, cuda_driver, tensor_scan
from sglang.srt.ray.rdt.transport.cma import CmaPath, export_cma
from sglang.srt.ray.rdt.transport.cuda_ipc import CudaIpcExporter, CudaIpcReader, KeptSource, NotKept
from sglang.srt.ray.rdt.transport.metadata import MappingFailed, ReadResult, SglangIpcTransportMetadata, Targets

__all__ = ["Targets", "export", "kept_mask", "keep", "NotKept", "read", "writable", "mapped", "unusable", "release",
           "token", "node_id", "reach"]

logger = logging.getLogger(__name__)
_TOKEN = uuid.uuid4().hex
_lock = threading.Lock()  # guards building the exporter and readers once
_exporter: Optional[CudaIpcExporter] = None
_ipc_reader: Optional[CudaIpcReader] = None
_cma: Optional[CmaPath] = None
_node_id: Optional[str] = None
_reach: Optional[Dict[str, Any]] = None
_own: Dict[int, tuple] = {}  # GPU ordinal -> ({base: size} of tensors granted to writers, its kept source)


def token() -> str:
    """This process's identity as a sender (readers key kept mappings by it)."""
    return _TOKEN


def node_id() -> str:
    global _node_id
    if _node_id is None:
        import ray

        _node_id = ray.get_runtime_context().get_node_id()
    return _node_id


def reach() -> Dict[str, Any]:
    """Where this process reads from: its Ray node and the UUIDs of the GPUs it sees."""
    global _reach
    if _reach is None:
        ordinals = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
        _reach = {"node_id": node_id(), "gpus": [cuda_driver.device_uuid(i) for i in ordinals]}
    return dict(_reach)


def _parts():
    global _exporter, _ipc_reader, _cma
    with _lock:
        if _exporter is None:
            _exporter = CudaIpcExporter(_TOKEN, lambda ptr: ptr in compat.nixl_registered_addresses())
            _ipc_reader, _cma = CudaIpcReader(), CmaPath()
        return _exporter, _ipc_reader, _cma


def keep(ordinal: int, source: KeptSource, add: bool = True) -> None:
    """Declare ``source``, listing ``(base, size)`` of kept segments of GPU ``ordinal`` (``add=False``: withdraw)."""
    exporter = _parts()[0]
    (exporter.add_source if add else exporter.remove_source)(ordinal, source)


def keep_registered(ordinal: int, storage_ptr: int) -> None:
    """The storage at ``storage_ptr`` on GPU ``ordinal`` is kept by its owner (it registered it with NIXL)."""
    _parts()[0].keep_registered(ordinal, storage_ptr)


def kept_mask(scan) -> np.ndarray:
    """Per tensor of ``scan`` (GPU tensors of one device): whether it lies in kept memory."""
    if not len(scan):
        return np.zeros(0, bool)
    return _parts()[0].kept_mask(scan.ptrs, scan.nbytes, int(scan.device[0]))


def export(tensors, with_specs: bool = True, scan=None) -> SglangIpcTransportMetadata:
    """Describe contiguous ``tensors`` of one device for a same-node reader (:class:`NotKept`: GPU tensors outside
    kept memory; ``scan``: theirs, if known). Queued work on them must be done before anyone reads them."""
    meta = SglangIpcTransportMetadata(
        tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors] if with_specs else [],
        tensor_device=tensors[0].device.type if tensors else None)
    if not tensors:
        return meta
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        meta.ipc_unavailable = f"tensors on {device.type}"
        return meta
    if scan is None:
        scan = tensor_scan.scan(tensors)
    return describe(scan.ptrs, scan.nbytes, device, meta)


def describe(ptrs: np.ndarray, nbytes: np.ndarray, device,
             meta: Optional[SglangIpcTransportMetadata] = None) -> SglangIpcTransportMetadata:
    """As :func:`export`, for the bytes at ``ptrs`` (``nbytes`` each) on ``device``."""
    if meta is None:
        meta = SglangIpcTransportMetadata(tensor_meta=[], tensor_device=device.type)
    if device.type == "cpu":
        meta.cma = export_cma(ptrs, nbytes, _TOKEN, node_id())
        if meta.cma is None:
            meta.ipc_unavailable = "/proc is not readable here"
    else:
        meta.ipc = _parts()[0].export(ptrs, nbytes, device.index, node_id())
    return meta


def writable(targets: Targets, device) -> SglangIpcTransportMetadata:
    """Describe this process's ``targets`` for a writer on this node (a rank grants its trainer its parameters; on
    a GPU their segments become kept memory)."""
    if device is None or device.type != "cuda":
        return describe(targets.ptrs, targets.nbytes, torch.device("cpu"))
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    exporter = _parts()[0]
    for fresh in (False, True):  # (a segment freed since: every segment looked up anew)
        if fresh or ordinal not in _own:
            if ordinal in _own:
                exporter.remove_source(ordinal, _own[ordinal][1])
            segments: Dict[int, int] = {}
            _own[ordinal] = (segments, lambda segments=segments: list(segments.items()))
            exporter.add_source(ordinal, _own[ordinal][1])
        try:
            if not exporter.kept_mask(targets.ptrs, targets.nbytes, ordinal).all():
                with cuda_driver.pushed(cuda_driver.driver(), ordinal) as drv:
                    _own[ordinal][0].update(drv.address_range(p) for p in set(targets.ptrs.tolist()))
            return describe(targets.ptrs, targets.nbytes, torch.device("cuda", ordinal))
        except cuda_driver.CudaDriverError:
            if fresh:
                raise


def mapped(meta: SglangIpcTransportMetadata, device):
    """The addresses here of another process's GPU tensors ``meta`` describes, mapped and kept (a context)."""
    why = unusable(meta, device)
    if why is not None or meta.ipc is None:
        raise MappingFailed(why or "not GPU memory")
    return _parts()[1].mapped(meta.ipc, device.index if device.index is not None else torch.cuda.current_device())


def unusable(meta: SglangIpcTransportMetadata, device) -> Optional[str]:
    """None when this process can read ``meta`` into tensors on ``device``, else why not."""
    _, ipc, cma = _parts()
    if meta.cma is not None:
        return cma.unusable(meta.cma, device, node_id())
    if meta.ipc is not None:
        return ipc.unusable(meta.ipc, device, node_id())
    return meta.ipc_unavailable or "the sender put no same-node part"


def read(meta: SglangIpcTransportMetadata, targets: Targets, device, copy: bool = True) -> ReadResult:
    """Read ``meta``'s tensors into ``targets`` (call :func:`unusable` first). Raises
    :class:`~.metadata.MappingFailed` when refused before any byte moved; any other error: bytes may have landed."""
    _, ipc, cma = _parts()
    if meta.cma is not None:
        return cma.read(meta.cma, targets, copy)
    return ipc.read(meta.ipc, targets, device, copy)


def gpu_uuid(device) -> Optional[str]:
    """The UUID of ``device``'s GPU, or None on the host."""
    if device is None or device.type != "cuda":
        return None
    return cuda_driver.device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def release(sender: Optional[str] = None, gone_only: bool = False) -> int:
    """Close ``sender``'s kept mappings (None: all; ``gone_only``: of exited processes); returns how many."""
    if _ipc_reader is None:
        return 0
    return _ipc_reader.release(sender, gone_only)


def warm(device) -> None:
    """Build the copy kernel of ``device`` now rather than in the first read."""
    try:
        cuda_driver.copy_kernel(device.index if device.index is not None else 0)
    except Exception as e:  # the read falls back to the copy engine and says why
        logger.info("[RDT] no SM copy kernel: %s", e)


def stats() -> Dict[str, int]:
    return _ipc_reader.stats() if _ipc_reader is not None else {"kept_mappings": 0}
