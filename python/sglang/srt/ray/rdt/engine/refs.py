"""What a rank reads from an RDT ref before (and after) fetching it: who put
it, its tensors' shapes and dtypes, and which path the fetch took.

Everything here reads Ray's own record of the ref (through
:mod:`sglang.srt.ray.rdt.transport.compat`), never the bytes.
"""

from __future__ import annotations

from typing import Any, List, Optional

from sglang.srt.ray.rdt.defaults import PULLABLE_TRANSPORTS, SGLANG_IPC
from sglang.srt.ray.rdt.engine.plan import TensorSpec
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.transport import compat


def transport_used(ref) -> str:
    """Which path a finished fetch of ``ref`` took: nixl | cuda_ipc | ..."""
    meta = compat.rdt_metadata(ref)
    backend = (meta.tensor_transport_backend if meta else "nixl").upper()
    if backend == "SGLANG_IPC":
        from sglang.srt.ray.rdt.transport import sglang_ipc

        info = sglang_ipc.fetch_info(ref)
        if info is not None:
            return info.path if not info.reason else f"{info.path} ({info.reason})"
    return backend.lower()


def ref_writer(ref) -> Writer:
    """Who put ``ref``: its RDT source actor, or the driver process that put it.

    Taken from Ray's own record of the object (the caller cannot omit or
    choose it), so two trainer processes are always two writers.
    """
    meta = compat.rdt_metadata(ref)
    src = getattr(meta, "src_actor", None)
    actor_id = getattr(src, "_actor_id", None)
    if actor_id is not None:
        label = f"actor {compat.actor_class_name(src) or 'Actor'}({actor_id.hex()[:12]})"
        return Writer(f"actor:{actor_id.hex()}", label)
    worker, ip = compat.ref_owner(ref)
    return Writer(f"worker:{worker}", f"driver worker {worker[:12]} at {ip}")


def ref_tensor_specs(ref, timeout_s: float) -> List[TensorSpec]:
    """Shapes and dtypes of an RDT ref's tensors, without fetching them."""
    import ray

    if not isinstance(ref, ray.ObjectRef):
        raise WeightSyncError(
            f"expected a ray.ObjectRef, got {type(ref).__name__}; put the tensors with "
            "ray.put(tensors, _tensor_transport='nixl') and pass the ref nested in a "
            "list (pull_weights.remote([ref], names)) so Ray does not resolve it"
        )
    meta = compat.rdt_metadata(ref)
    if meta is None:
        raise WeightSyncError(
            f"{ref} is not an RDT object: put it with "
            "ray.put(tensors, _tensor_transport='nixl')"
        )
    if meta.tensor_transport_backend.upper() not in PULLABLE_TRANSPORTS:
        raise WeightSyncError(
            f"{ref} uses tensor transport {meta.tensor_transport_backend!r}; "
            "pull_weights needs 'nixl' (or 'SGLANG_IPC', the same-node CUDA IPC "
            "fast path of sglang.srt.ray.rdt.transport.sglang_ipc)"
        )
    transport_meta = meta.tensor_transport_meta
    if transport_meta is None:
        transport_meta = compat.wait_transport_metadata(ref, timeout_s)
        if transport_meta is None:
            raise WeightSyncError(
                f"{ref}: the sender did not create the object within {timeout_s:.0f} s"
            )
    return [TensorSpec.of(entry) for entry in transport_meta.tensor_meta]


def _transport_meta(ref, backend: str):
    """The tensor-transport metadata of a ref put with ``backend`` (upper
    case), or None (another transport, or not there yet)."""
    meta = compat.rdt_metadata(ref)
    if meta is None or meta.tensor_transport_backend.upper() != backend:
        return None
    return meta.tensor_transport_meta


def fetch_same_node(ref, targets, copy: bool = True, while_copying=None) -> Optional[List[Any]]:
    """Fetch an ``SGLANG_IPC`` ref into ``targets`` over the same-node path
    directly (no ``ray.get``); None when that path does not serve it here
    (``SGLANG_RDT_DIRECT_FETCH=0``: never). ``copy=False``: open what the
    fetch needs, write nothing. ``while_copying``: see
    :meth:`SglangIpcTransport.fetch_same_node`."""
    from sglang.srt.environ import envs

    if not envs.SGLANG_RDT_DIRECT_FETCH.get():
        return None
    tm = _transport_meta(ref, SGLANG_IPC)
    if tm is None:
        return None
    from sglang.srt.ray.rdt.transport import sglang_ipc

    return sglang_ipc.transport().fetch_same_node(ref.hex(), tm, targets, copy=copy,
                                                  while_copying=while_copying)


def cuda_ipc_ref(ref) -> bool:
    """Whether a pull reads ``ref`` with :func:`fetch_same_node` over CUDA IPC
    when this node can: an ``SGLANG_IPC`` ref of GPU tensors (and direct
    fetches are on)."""
    from sglang.srt.environ import envs

    return (getattr(_transport_meta(ref, SGLANG_IPC), "ipc", None) is not None
            and envs.SGLANG_RDT_DIRECT_FETCH.get())


def nixl_job(ref, targets):
    """``(object id, NIXL metadata, targets)`` for :func:`compat.nixl_read`
    when a NIXL ref can be read without ``ray.get`` here, else None (not a
    NIXL ref, metadata not there yet, or ``SGLANG_RDT_DIRECT_FETCH=0``).
    ``ray.get`` costs a round trip to the ref's owner and polls the transfer
    every 1 ms; the same read through this process's NIXL agent does not."""
    from sglang.srt.environ import envs

    if not targets or not envs.SGLANG_RDT_DIRECT_FETCH.get():
        return None
    tm = _transport_meta(ref, "NIXL")
    if tm is None:
        return None
    return ref.hex(), tm, targets


def same_node_sender(ref) -> Optional[str]:
    """The sender process token of an ``SGLANG_IPC`` ref readable on its node
    (CUDA IPC or process_vm_readv part), else None."""
    tm = _transport_meta(ref, SGLANG_IPC)
    part = getattr(tm, "ipc", None) or getattr(tm, "cma", None)
    return getattr(part, "sender", None)


SAME_GPU_NIXL = (
    "UCX has no path between two processes on one GPU and falls back to TCP over "
    "loopback (measured: 0.5 GB/s on an H200, ~4000x slower than the on-device "
    "copy). Put the weights with ray.put(tensors, _tensor_transport='SGLANG_IPC') "
    "(WeightSyncClient's default transport='auto' does): on one node it copies "
    "GPU to GPU through CUDA IPC"
)


def nixl_source_on_this_gpu(ref, device) -> Optional[str]:
    """Why a NIXL ref looks like it was put on this rank's own GPU, or None.

    Same host (the ref's owner address) and the same device index in the
    ref's NIXL descriptors as ``device``'s. Device indices are absolute only
    when the sender sees every GPU (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES,
    as RDT ranks do), so this is a strong hint, not proof.
    """
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    meta = compat.rdt_metadata(ref)
    if meta is None or meta.tensor_transport_backend.upper() != "NIXL":
        return None
    tm = meta.tensor_transport_meta
    descs = getattr(tm, "nixl_serialized_descs", None)
    if not descs:
        return None
    try:
        import pickle

        import ray

        first = pickle.loads(descs)[0]  # (address, bytes, device id)
        _, ip = compat.ref_owner(ref)
        here = ray.util.get_node_ip_address()
    except Exception:  # an unexpected NIXL/Ray layout: no hint
        return None
    if ip != here or int(first[2]) != int(device.index or 0):
        return None
    return f"the NIXL ref {ref.hex()[:16]} was put on this node from GPU {first[2]}, this rank's GPU"
