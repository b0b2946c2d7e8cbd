"""``SGLANG_IPC``: a Ray tensor transport that reads on the sender's node without NIXL.

A ref carries a same-node part and Ray's NIXL metadata of the same tensors; a reader that cannot use the same-node
part reads through NIXL. Ray pushes a custom transport to new actors asynchronously: see :func:`register`."""

from __future__ import annotations

import logging
from typing import Any, List

import torch

from sglang.srt.ray.rdt.transport import compat, nixl_threads, same_node
from sglang.srt.ray.rdt.transport.metadata import (IpcCommunicatorMetadata, MappingFailed, SglangIpcTransportMetadata,
                                                   Targets)

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "SGLANG_IPC"

_TransportManager = compat.transport_base_classes()[1]


class SglangIpcTransport(_TransportManager):  # type: ignore[misc,valid-type]
    """Ray's manager of ``SGLANG_IPC`` in one process."""

    def __init__(self):
        self._warned: set = set()

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
        if not rdt_object:
            return SglangIpcTransportMetadata(tensor_meta=[], tensor_device=None)
        device = rdt_object[0].device
        if any(t.device.type != device.type for t in rdt_object):
            raise ValueError("All tensors in an RDT object must be on one device type.")
        if any(not t.is_contiguous() for t in rdt_object):
            raise ValueError("All tensors in an RDT object must be contiguous.")
        # Kept GPU memory is what was registered before this put: NIXL's put registers every tensor it sends.
        table = compat.nixl_registered_addresses() if device.type == "cuda" else {}
        kept = {p for p in {t.untyped_storage().data_ptr() for t in rdt_object} if p in table} if table else ()
        # NIXL's put synchronises the tensors' devices first: the same-node part describes final bytes.
        nixl_threads.start_nixl_agent()
        nixl = self._nixl().extract_tensor_transport_metadata(obj_id, rdt_object)
        if device.type == "cuda" and any(t.device != device for t in rdt_object):
            meta = SglangIpcTransportMetadata(tensor_meta=[(tuple(t.shape), t.dtype) for t in rdt_object],
                                              tensor_device="cuda", ipc_unavailable="tensors on several devices")
        else:
            meta = self._same_node_part(rdt_object, kept)
        meta.nixl = nixl
        return meta

    @staticmethod
    def _same_node_part(tensors, kept) -> SglangIpcTransportMetadata:
        """The same-node part of host memory or kept GPU memory (``kept``: registered storages); other GPU memory
        gets none (read through NIXL)."""
        for ptr in kept:
            same_node.keep_registered(tensors[0].device.index, ptr)
        try:
            return same_node.export(tensors)
        except same_node.NotKept as e:
            return SglangIpcTransportMetadata(
                tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors], tensor_device="cuda",
                ipc_unavailable=f"{e}: register it with ray.experimental.register_nixl_memory, "
                                "or put tensors made inside WeightSyncClient.staging()")

    def recv_multiple_tensors(self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers=None):
        meta = tensor_transport_metadata
        assert isinstance(meta, SglangIpcTransportMetadata), type(meta)
        if not meta.tensor_meta:
            return []
        if target_buffers:
            targets = list(target_buffers)
        else:
            device = torch.device("cpu") if meta.cma is not None else torch.device("cuda", torch.cuda.current_device())
            targets = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta.tensor_meta]
        device = targets[0].device
        why = same_node.unusable(meta, device)
        if why is None:
            try:
                same_node.read(meta, Targets.of(targets), device)
                return targets
            except MappingFailed as e:  # refused before any byte moved
                why = str(e)
        if meta.nixl is None:
            raise ValueError(f"this {TRANSPORT_NAME} ref cannot be read here ({why}) and carries no NIXL metadata")
        if why not in self._warned:
            self._warned.add(why)
            logger.info("[RDT] %s: reading through NIXL (%s)", TRANSPORT_NAME, why)
        return self._nixl().recv_multiple_tensors(
            obj_id, meta.nixl, compat.nixl_communicator_metadata(), target_buffers)

    def send_multiple_tensors(self, tensors, tensor_transport_metadata, communicator_metadata):
        raise NotImplementedError(f"{TRANSPORT_NAME} is one-sided")

    def garbage_collect(self, obj_id, tensor_transport_meta, tensors):
        if getattr(tensor_transport_meta, "nixl", None) is not None:
            self._nixl().garbage_collect(obj_id, tensor_transport_meta.nixl, tensors)

    def abort_transport(self, obj_id, communicator_metadata):
        # A same-node copy is short and synchronous; only a NIXL read can be in flight.
        self._nixl().abort_transport(obj_id, compat.nixl_communicator_metadata())


def register() -> str:
    """Register the transport in this process (idempotent); returns its name. Call
    it before creating the actors, and in every actor that puts or gets with it."""
    compat.register_transport(TRANSPORT_NAME, ["cuda", "cpu"], SglangIpcTransport, torch.Tensor)
    return TRANSPORT_NAME
