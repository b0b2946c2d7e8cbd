"""Every access to Ray's and NIXL's private internals, in one place and read-only; each accessor below was read
from Ray 2.60.0. :func:`check_versions` warns once per process when the installed Ray or NIXL differs."""

from __future__ import annotations

import logging
import threading
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

# The versions these accessors were written and tested against.
RAY_VERSIONS = ("2.60.0",)
NIXL_VERSIONS = ("1.5.1",)

_checked = False
_check_lock = threading.Lock()  # the version check runs once


def check_versions() -> None:
    """Warn once per process when Ray or NIXL is not a version these accessors were written for."""
    global _checked
    if _checked:  # every ref lookup lands here: no lock once done
        return
    with _check_lock:
        if _checked:
            return
        _checked = True
    problems = []
    try:
        import ray

        if ray.__version__ not in RAY_VERSIONS:
            problems.append(f"ray {ray.__version__} (written for {', '.join(RAY_VERSIONS)})")
    except ImportError:
        return
    try:
        from importlib.metadata import version

        nixl_version = version("nixl")
    except Exception:  # not installed, or its metadata unreadable
        nixl_version = None
    if nixl_version is not None and nixl_version not in NIXL_VERSIONS:
        problems.append(f"nixl {nixl_version} (written for {', '.join(NIXL_VERSIONS)})")
    if problems:
        logger.warning("[RDT] weight sync reaches into private parts of %s; if a weight-sync call fails with an "
                       "AttributeError or ImportError, sglang/srt/ray/rdt/transport/compat.py is the place to update",
                       " and ".join(problems))


def transport_base_classes() -> Tuple[type, type, type]:
    """Ray's (CommunicatorMetadata, TensorTransportManager, TensorTransportMetadata); ``object`` without Ray."""
    try:
        from ray.experimental.rdt.tensor_transport_manager import (CommunicatorMetadata, TensorTransportManager,
                                                                   TensorTransportMetadata)
    except ImportError:  # pragma: no cover - Ray without RDT
        return object, object, object
    return CommunicatorMetadata, TensorTransportManager, TensorTransportMetadata


def transport_manager(name: str):
    """This process's manager of tensor transport ``name`` (created on first use)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager(name)


def register_transport(name: str, devices, manager_class: type, data_type: type) -> None:
    """Register a custom tensor transport in this process (idempotent: Ray's push of it to a new actor may
    have registered it already). Uses ``ray.experimental.rdt.util``'s private registry (Ray 2.60)."""
    from ray.experimental.rdt import util

    check_versions()
    util._ensure_default_transports_registered()
    if name in util.transport_manager_info:
        return
    try:
        util.register_tensor_transport(name, devices, manager_class, data_type)
    except ValueError as e:
        if "already registered" not in str(e):
            raise


def nixl_communicator_metadata():
    """The (empty) communicator metadata Ray's NIXL transport takes."""
    from ray.experimental.rdt.nixl_tensor_transport import NixlCommunicatorMetadata

    return NixlCommunicatorMetadata()


def nixl_registered_addresses():
    """The storage addresses registered with NIXL in this process (``register_nixl_memory``, or a put whose ref
    lives), as a container: their owner keeps them, so the same-node path may map them once. Ray's NIXL
    transport's registration table, keyed by storage address (Ray 2.60)."""
    return getattr(transport_manager("NIXL"), "_tensor_desc_cache", None) or {}


def rdt_manager():
    """This worker's RDT manager (what ``ray.get`` of an RDT ref goes through)."""
    import ray

    check_versions()
    return ray._private.worker.global_worker.rdt_manager


def rdt_metadata(ref):
    """Ray's record of an RDT ref (transport, source actor, tensor metadata), or None."""
    return rdt_manager().get_rdt_metadata(ref.hex())


def wait_transport_metadata(ref, timeout_s: float):
    """The ref's tensor-transport metadata, waiting up to ``timeout_s`` for it."""
    return rdt_manager().wait_for_tensor_transport_metadata(ref.hex(), timeout_s)


def ref_owner(ref) -> Tuple[str, str]:
    """(worker id hex, ip) of the process that owns ``ref`` (who put it)."""
    from ray.core.generated.common_pb2 import Address

    owner = Address()
    owner.ParseFromString(ref.owner_address())
    return owner.worker_id.hex(), owner.ip_address


def actor_class_name(handle) -> Optional[str]:
    """The class name of an actor handle, if Ray's descriptor has one."""
    descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    return getattr(descriptor, "class_name", None)


def job_table() -> list:
    """The GCS job table (``JobID``, ``IsDead``, ...)."""
    from ray._private import state

    return state.jobs()
