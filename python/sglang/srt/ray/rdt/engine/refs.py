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


# Every function here that reads Ray's record of a ref takes it as ``meta``
# when the caller looked it up already (a pull looks each ref up once), else
# looks it up itself.
_LOOKUP = object()


def transport_used(ref, meta=_LOOKUP) -> str:
    """Which path a finished fetch of ``ref`` took: nixl | cuda_ipc | ..."""
    meta = compat.rdt_metadata(ref) if meta is _LOOKUP else meta
    backend = (meta.tensor_transport_backend if meta else "nixl").upper()
    if backend == "SGLANG_IPC":
        from sglang.srt.ray.rdt.transport import sglang_ipc

        info = sglang_ipc.fetch_info(ref)
        if info is not None:
            return info.path if not info.reason else f"{info.path} ({info.reason})"
    return backend.lower()


_actor_writers: dict = {}  # ActorID -> Writer (its label costs a few us to build)


def ref_writer(ref, meta=_LOOKUP) -> Writer:
    """Who put ``ref``: its RDT source actor, or the driver process that put it.

    Taken from Ray's own record of the object (the caller cannot omit or
    choose it), so two trainer processes are always two writers.
    """
    meta = compat.rdt_metadata(ref) if meta is _LOOKUP else meta
    src = getattr(meta, "src_actor", None)
    actor_id = getattr(src, "_actor_id", None)
    if actor_id is not None:
        writer = _actor_writers.get(actor_id)
        if writer is None:  # a trainer actor puts every bucket of every update
            label = f"actor {compat.actor_class_name(src) or 'Actor'}({actor_id.hex()[:12]})"
            writer = Writer(f"actor:{actor_id.hex()}", label)
            if len(_actor_writers) >= 64:
                _actor_writers.pop(next(iter(_actor_writers)))
            _actor_writers[actor_id] = writer
        return writer
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


def _transport_meta(ref, backend: str, meta=_LOOKUP):
    """The tensor-transport metadata of a ref put with ``backend`` (upper
    case), or None (another transport, or not there yet)."""
    meta = compat.rdt_metadata(ref) if meta is _LOOKUP else meta
    if meta is None or meta.tensor_transport_backend.upper() != backend:
        return None
    return meta.tensor_transport_meta


def fetch_same_node(ref, targets, copy: bool = True, while_copying=None, meta=_LOOKUP,
                    direct: Optional[bool] = None) -> Optional[List[Any]]:
    """Fetch an ``SGLANG_IPC`` ref into ``targets`` over the same-node path
    directly (no ``ray.get``); None when that path does not serve it here
    (``SGLANG_RDT_DIRECT_FETCH=0``: never). ``copy=False``: open what the
    fetch needs, write nothing. ``while_copying``: see
    :meth:`SglangIpcTransport.fetch_same_node`. ``direct``: the value of
    ``SGLANG_RDT_DIRECT_FETCH`` when the caller read it already."""
    if not (direct_fetch() if direct is None else direct):
        return None
    tm = _transport_meta(ref, SGLANG_IPC, meta)
    if tm is None:
        return None
    from sglang.srt.ray.rdt.transport import sglang_ipc

    return sglang_ipc.transport().fetch_same_node(ref.hex(), tm, targets, copy=copy,
                                                  while_copying=while_copying)


def direct_fetch() -> bool:
    """``SGLANG_RDT_DIRECT_FETCH``: reads without ``ray.get`` are allowed."""
    from sglang.srt.environ import envs

    return envs.SGLANG_RDT_DIRECT_FETCH.get()


def cuda_ipc_ref(ref, meta=_LOOKUP, direct: Optional[bool] = None) -> bool:
    """Whether a pull reads ``ref`` with :func:`fetch_same_node` over CUDA IPC
    when this node can: an ``SGLANG_IPC`` ref of GPU tensors (and direct
    fetches are on)."""
    return (getattr(_transport_meta(ref, SGLANG_IPC, meta), "ipc", None) is not None
            and (direct_fetch() if direct is None else direct))


def nixl_job(ref, targets, meta=_LOOKUP, direct: Optional[bool] = None):
    """``((object id, NIXL metadata, targets), why)`` for
    :func:`nixl_reader.read` when the ref can be read through NIXL without
    ``ray.get`` here, else None (no NIXL metadata, metadata not there yet, or
    ``SGLANG_RDT_DIRECT_FETCH=0``). ``why`` is None for a NIXL ref; for an
    ``SGLANG_IPC`` ref (asked after :func:`fetch_same_node` returned None):
    why its same-node path does not serve it here — pass it to
    :func:`note_nixl_read` once read. ``ray.get`` costs a round trip to the
    ref's owner and polls the transfer every 1 ms; the same read through
    this process's NIXL agent does not."""
    if not targets or not (direct_fetch() if direct is None else direct):
        return None
    meta = compat.rdt_metadata(ref) if meta is _LOOKUP else meta
    tm = _transport_meta(ref, "NIXL", meta)
    if tm is not None:
        return (ref.hex(), tm, targets), None
    tm = _transport_meta(ref, SGLANG_IPC, meta)
    if tm is None:
        return None
    from sglang.srt.ray.rdt.transport import sglang_ipc

    part = sglang_ipc.transport().nixl_part(tm, targets)
    if part is None:
        return None
    return (ref.hex(), part[0], targets), part[1]


def note_nixl_read(ref, why: str, targets, seconds: float) -> None:
    """Record that an ``SGLANG_IPC`` ref was read through its NIXL part
    (:func:`transport_used` then says ``nixl (why)``)."""
    from sglang.srt.ray.rdt.transport import sglang_ipc

    sglang_ipc.transport().note_nixl_read(ref.hex(), why, targets, seconds)


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
