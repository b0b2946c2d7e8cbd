"""Where a pull's bytes come from: :class:`RefSource` (an RDT ref) or :class:`LocalSource` (a lane request).

Each has ``writer()``, ``specs()`` and ``read()`` (itself into the pull's targets, returning a ``ReadResult``)."""

from __future__ import annotations

import logging
import time
from typing import Any, List, Optional

from sglang.srt.ray.rdt.defaults import PULLABLE_TRANSPORTS, SGLANG_IPC
from sglang.srt.ray.rdt.engine.plan import TensorSpec
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.transport import compat, nixl_threads, same_node
from sglang.srt.ray.rdt.transport.metadata import MappingFailed, ReadResult, Targets

logger = logging.getLogger(__name__)


class NotReadable(WeightSyncError):
    """A source cannot be read here; nothing was written."""


class RefSource:
    """An RDT ``ObjectRef`` (NIXL or ``SGLANG_IPC``)."""

    def __init__(self, ref):
        import ray

        if not isinstance(ref, ray.ObjectRef):
            raise WeightSyncError(
                f"expected a ray.ObjectRef, got {type(ref).__name__}; put the tensors with "
                "ray.put(tensors, _tensor_transport='nixl') and pass the ref nested in a "
                "list (pull_weights.remote([ref], names)) so Ray does not resolve it")
        meta = compat.rdt_metadata(ref)
        if meta is None:
            raise WeightSyncError(f"{ref} is not an RDT object: put it with ray.put(tensors, _tensor_transport='nixl')")
        self.backend = meta.tensor_transport_backend.upper()
        if self.backend not in PULLABLE_TRANSPORTS:
            raise WeightSyncError(
                f"{ref} uses tensor transport {meta.tensor_transport_backend!r}; pull_weights needs 'nixl' (or "
                "'SGLANG_IPC', the same-node transport of sglang.srt.ray.rdt.transport.sglang_ipc)")
        self.ref, self._meta = ref, meta

    def transport_meta(self, timeout_s: float):
        tm = self._meta.tensor_transport_meta
        if tm is None:  # the sender has not created the object yet
            tm = compat.wait_transport_metadata(self.ref, timeout_s)
            if tm is None:
                raise WeightSyncError(f"{self.ref}: the sender did not create the object within {timeout_s:.0f} s")
            self._meta = compat.rdt_metadata(self.ref)
        return tm

    def specs(self, timeout_s: float) -> List[TensorSpec]:
        return [TensorSpec.of(e) for e in self.transport_meta(timeout_s).tensor_meta]

    def writer(self) -> Writer:
        src = getattr(self._meta, "src_actor", None)
        actor_id = getattr(src, "_actor_id", None)
        if actor_id is not None:
            label = f"actor {compat.actor_class_name(src) or 'Actor'}({actor_id.hex()[:12]})"
            return Writer(f"actor:{actor_id.hex()}", label)
        worker, ip = compat.ref_owner(self.ref)
        return Writer(f"worker:{worker}", f"driver worker {worker[:12]} at {ip}")

    def read(self, targets: Targets, device, timeout_s: float) -> ReadResult:
        why = None
        if self.backend == SGLANG_IPC:
            tm = self.transport_meta(timeout_s)
            why = same_node.unusable(tm, device)
            if why is None:
                try:
                    return same_node.read(tm, targets, device)
                except MappingFailed as e:  # refused before any byte moved
                    why = str(e)
            if tm.nixl is None:
                raise NotReadable(f"{self.ref} cannot be read here ({why}) and carries no NIXL metadata")
        return self._ray_get(targets, timeout_s, why)

    def _ray_get(self, targets: Targets, timeout_s: float, why: Optional[str]) -> ReadResult:
        """NIXL through Ray, which holds the targets weakly: ``targets`` stays referenced here until
        ``ray.get`` returns. Every returned tensor must *be* its target."""
        import ray
        from ray.experimental import set_target_for_ref

        t0 = time.perf_counter()
        nixl_threads.start_nixl_agent()  # (once per process) its progress thread at idle priority
        set_target_for_ref(self.ref, targets.tensors)
        got = ray.get(self.ref, timeout=timeout_s)
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        if len(got) != len(targets.tensors) or any(
                getattr(g, "data_ptr", lambda: None)() != int(p) for g, p in zip(got, targets.ptrs)):
            raise InPlaceError("a tensor was fetched into a new buffer instead of the live parameter (target "
                               "dropped by Ray?); the model was not updated in place")
        return ReadResult("nixl", len(got), int(targets.nbytes.sum()), time.perf_counter() - t0,
                          reason=why, method="nixl", copy_seconds=time.perf_counter() - t0)


class InPlaceError(RuntimeError):
    """Ray fetched into buffers of its own: bytes may be missing in the parameters."""


class LocalSource:
    """A same-node description from the rank's call lane."""

    def __init__(self, meta, writer: Writer, specs: List[TensorSpec]):
        self.meta, self._writer, self._specs = meta, writer, specs

    def specs(self, timeout_s: float) -> List[TensorSpec]:
        return self._specs

    def writer(self) -> Writer:
        return self._writer

    def read(self, targets: Targets, device, timeout_s: float, copy: bool = True) -> ReadResult:
        why = same_node.unusable(self.meta, device)
        if why is not None:
            raise NotReadable(f"the trainer's tensors cannot be read from this rank: {why}")
        try:
            return same_node.read(self.meta, targets, device, copy)
        except MappingFailed as e:
            raise NotReadable(f"the trainer's tensors cannot be read from this rank: {e}") from e


def sources_of(refs) -> List[Any]:
    """``pull_weights``' refs as sources (a bad call is refused before anything moves)."""
    import ray

    if refs is None or isinstance(refs, ray.ObjectRef):
        raise WeightSyncError("weights_refs must be a list of refs: pull_weights.remote([ref], names)")
    refs = list(refs)
    if not refs:
        raise WeightSyncError("empty pull: no refs were given")
    return [RefSource(r) for r in refs]
