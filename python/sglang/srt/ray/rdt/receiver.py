"""The receiving side of RDT weight sync: NIXL writes straight into live parameters.

:class:`RdtWeightReceiver` is what a SchedulerActor's ``pull_weights`` runs. It
is independent of the scheduler (it gets the parameters from a callable), so it
is tested in a plain Ray actor around a toy model as well as in a real server.

A pull:

1. reads the tensor metadata (shape, dtype) of every ref without fetching;
2. checks every name, shape, dtype and contiguity against the live parameters
   (:func:`sglang.srt.ray.rdt.plan.plan_pull`) — a rejected pull moves no byte;
3. points ``ray.experimental.set_target_for_ref`` at the parameters' storage and
   keeps the target lists alive until ``ray.get`` returns (Ray holds only weak
   references: if the targets die, Ray silently allocates fresh tensors and the
   model is not updated);
4. fetches all refs with one bounded ``ray.get`` and checks that every returned
   tensor *is* its target (same data pointer) — otherwise the pull fails loudly.

Before step 3 the rank's :class:`~sglang.srt.ray.rdt.update_state.RankUpdateState`
admits the pull (no parameter may be written by two writers in one update);
after step 4 it records what landed and who wrote it. A failure in step 4 can
leave some parameters written and others not; the state then reports the
rank's weights as inconsistent until a clean update ends.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from sglang.srt.ray.rdt.nixl_progress import configure_nixl_progress_thread
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError
from sglang.srt.ray.rdt.update_state import RankUpdateState, Writer
from sglang.srt.ray.rdt.plan import (
    TensorSpec,
    group_names,
    plan_pull,
    storage_key,
    unique_storages,
)

logger = logging.getLogger(__name__)

DEFAULT_PULL_TIMEOUT_S = 60.0
# NIXL, and the same-node CUDA IPC transport (which falls back to NIXL itself).
PULLABLE_TRANSPORTS = ("NIXL", "SGLANG_IPC")


def transport_used(ref) -> str:
    """Which path a finished fetch of ``ref`` took: nixl | cuda_ipc | ..."""
    meta = _rdt_manager().get_rdt_metadata(ref.hex())
    backend = (meta.tensor_transport_backend if meta else "nixl").upper()
    if backend == "SGLANG_IPC":
        from sglang.srt.ray.rdt import cuda_ipc_transport

        info = cuda_ipc_transport.fetch_info(ref)
        if info is not None:
            return info.path if not info.reason else f"{info.path} ({info.reason})"
    return backend.lower()


def _rdt_manager():
    import ray

    return ray._private.worker.global_worker.rdt_manager


def ref_writer(ref) -> Writer:
    """Who put ``ref``: its RDT source actor, or the driver process that put it.

    Taken from Ray's own record of the object (the caller cannot omit or
    choose it), so two trainer processes are always two writers.
    """
    meta = _rdt_manager().get_rdt_metadata(ref.hex())
    src = getattr(meta, "src_actor", None)
    actor_id = getattr(src, "_actor_id", None)
    if actor_id is not None:
        name = getattr(getattr(src, "_ray_actor_creation_function_descriptor", None),
                       "class_name", None)
        label = f"actor {name or 'Actor'}({actor_id.hex()[:12]})"
        return Writer(f"actor:{actor_id.hex()}", label)
    from ray.core.generated.common_pb2 import Address

    owner = Address()
    owner.ParseFromString(ref.owner_address())
    worker = owner.worker_id.hex()
    return Writer(f"worker:{worker}", f"driver worker {worker[:12]} at {owner.ip_address}")


def ref_tensor_specs(ref, timeout_s: float) -> List[TensorSpec]:
    """Shapes and dtypes of an RDT ref's tensors, without fetching them."""
    import ray

    if not isinstance(ref, ray.ObjectRef):
        raise WeightSyncError(
            f"expected a ray.ObjectRef, got {type(ref).__name__}; put the tensors with "
            "ray.put(tensors, _tensor_transport='nixl') and pass the ref nested in a "
            "list (pull_weights.remote([ref], names)) so Ray does not resolve it"
        )
    manager = _rdt_manager()
    meta = manager.get_rdt_metadata(ref.hex())
    if meta is None:
        raise WeightSyncError(
            f"{ref} is not an RDT object: put it with "
            "ray.put(tensors, _tensor_transport='nixl')"
        )
    if meta.tensor_transport_backend.upper() not in PULLABLE_TRANSPORTS:
        raise WeightSyncError(
            f"{ref} uses tensor transport {meta.tensor_transport_backend!r}; "
            "pull_weights needs 'nixl' (or 'SGLANG_IPC', the same-node CUDA IPC "
            "fast path of sglang.srt.ray.rdt.cuda_ipc_transport)"
        )
    transport_meta = meta.tensor_transport_meta
    if transport_meta is None:
        transport_meta = manager.wait_for_tensor_transport_metadata(ref.hex(), timeout_s)
        if transport_meta is None:
            raise WeightSyncError(
                f"{ref}: the sender did not create the object within {timeout_s:.0f} s"
            )
    return [TensorSpec.of(entry) for entry in transport_meta.tensor_meta]


_EXPANDABLE_CHECKED = False


def expandable_segment_tensors(tensors, snapshot=None) -> List[torch.Tensor]:
    """The CUDA tensors that live in expandable (VMM) segments.

    VMM memory cannot be exported through legacy CUDA IPC, and UCX then falls
    back to TCP (~0.3 GB/s) without an error.
    """
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda:
        return []
    if snapshot is None:
        snapshot = torch.cuda.memory_snapshot()
    spans = [
        (seg["address"], seg["address"] + seg["total_size"])
        for seg in snapshot
        if seg.get("is_expandable")
    ]
    if not spans:
        return []
    return [t for t in cuda if any(lo <= t.data_ptr() < hi for lo, hi in spans)]


def warn_if_expandable_segments(tensors, snapshot=None, *, once: bool = True) -> bool:
    """Warn (once per process) if any CUDA tensor lives in an expandable segment."""
    global _EXPANDABLE_CHECKED
    if once and _EXPANDABLE_CHECKED:
        return False
    if any(t.is_cuda for t in tensors):
        _EXPANDABLE_CHECKED = True  # the allocator snapshot is not free: look once
    try:
        hits = expandable_segment_tensors(tensors, snapshot)
    except Exception:  # the allocator cannot tell; nothing to warn about
        return False
    if hits:
        logger.warning(
            "[RDT] %d of %d tensors live in CUDA expandable segments "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): NIXL/UCX cannot "
            "export them over CUDA IPC and silently falls back to TCP (~0.3 GB/s). "
            "Unset expandable_segments for the rollout engine and the trainer's "
            "weight buckets.",
            len(hits), len(tensors),
        )
        return True
    return False


def close_cached_mappings(keep_persistent: bool = False, sender: Optional[str] = None) -> int:
    """Close cached CUDA IPC mappings of trainer memory: all, all but those of
    persistent sender buffers, or those of one ``sender``."""
    import sys

    mod = sys.modules.get("sglang.srt.ray.rdt.cuda_ipc_transport")
    if mod is None:
        return 0
    if sender is not None:
        return mod.release_sender_mappings(sender)
    return mod.close_ipc_mappings(keep_persistent=keep_persistent)


class RegistrationBook:
    """NIXL registrations of parameter storage, keyed by (device, address, size).

    NIXL keys registrations by address: a stale one (memory freed, re-used or
    grown) gives NIXL_ERR_NOT_FOUND or, worse, lets a transfer write into
    memory that now belongs to something else. ``sync`` drops entries whose
    storage is gone or changed and registers the current ones; ``release_all``
    drops everything (before weights are released, e.g. by the memory saver).
    """

    def __init__(self, register=None, deregister=None):
        if register is None or deregister is None:
            from ray.experimental import deregister_nixl_memory, register_nixl_memory

            register, deregister = register_nixl_memory, deregister_nixl_memory
        self._register, self._deregister = register, deregister
        self._entries: Dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(k[2] for k in self._entries)

    def covers(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._entries

    def sync(self, tensors: Sequence[torch.Tensor]) -> Dict[str, int]:
        """Make the registrations exactly the storages of ``tensors``."""
        current = {storage_key(t): t for t in unique_storages(tensors)}
        dropped = 0
        for key in [k for k in self._entries if k not in current]:
            self._deregister(self._entries.pop(key))
            dropped += 1
        added = 0
        for key, t in current.items():
            if key not in self._entries:
                self._register(t)
                self._entries[key] = t
                added += 1
        return {"added": added, "dropped": dropped}

    def release_all(self) -> int:
        n = 0
        for k, t in list(self._entries.items()):
            try:
                self._deregister(t)
            finally:
                del self._entries[k]
                n += 1
        return n


# Pull plans kept (one per bucket layout a trainer sends; miles sends the same
# few every update).
MAX_CACHED_PLANS = 256


class _Plan:
    """The targets :func:`plan_pull` chose for one layout, and what each
    target parameter was when planned: object, address, shape, dtype, strides."""

    __slots__ = ("targets", "_checks")

    def __init__(self, targets: List[List[torch.Tensor]], params: Sequence[torch.Tensor]):
        self.targets = targets
        self._checks = [(p, p.data_ptr(), p.shape, p.dtype, p.stride()) for p in params]

    def still_live(self) -> bool:
        """Every target parameter still has the storage and layout it was
        planned with (``param.data = new`` or a re-allocation changes the
        address: the old storage cannot be handed out again while the plan
        holds a view of it; a re-view of the same storage changes shape,
        dtype or strides)."""
        for p, ptr, shape, dtype, stride in self._checks:
            if p.data_ptr() != ptr or p.shape != shape or p.dtype != dtype or p.stride() != stride:
                return False
        return True


class RdtWeightReceiver:
    """Pull RDT refs into the live parameters returned by ``get_params``."""

    def __init__(
        self,
        get_params: Callable[[], Mapping[str, torch.Tensor]],
        *,
        device: Optional[torch.device] = None,
        pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        registration_disabled_reason: Optional[str] = None,
        registrations: Optional[RegistrationBook] = None,
        state: Optional[RankUpdateState] = None,
    ):
        # Before this process's NIXL agent exists: its progress thread must
        # not spin a core for the life of the rank (see nixl_progress).
        configure_nixl_progress_thread()
        self._get_params = get_params
        self._device = device
        self.pull_timeout_s = pull_timeout_s
        self._registration_disabled_reason = registration_disabled_reason
        self._registrations = registrations
        self._lock = threading.Lock()
        self._closed = False
        self._want_registered = False
        self._registered_layout = None  # params' (data_ptr, numel) at the last sync
        self._weights_released = False
        # The live parameters as one walk of the model found them, and the
        # pull plans made against them (see _plan: when they are trusted,
        # checked again, or dropped).
        self._params: Optional[Mapping[str, torch.Tensor]] = None
        self._plans: Dict[tuple, "_Plan"] = {}
        self._params_stale = False  # walk again, but plans may survive
        # What updates wrote, consistency and counters (the rank's one owner).
        self.state = state or RankUpdateState(param_names=lambda: list(get_params()))

    # ------------------------------------------------------------------ #
    # Registration
    # ------------------------------------------------------------------ #
    def register(self) -> Dict[str, Any]:
        if self._registration_disabled_reason:
            logger.info(
                "[RDT] register_weight_for_rdt skipped: %s", self._registration_disabled_reason
            )
            return {"registered": False, "reason": self._registration_disabled_reason}
        with self._lock:
            self._check_open()
            self._bind_device()
            if self._registrations is None:
                self._registrations = RegistrationBook()
            if self._weights_released:
                raise WeightSyncError(
                    "weights are released (memory saver); resume memory occupation first"
                )
            t0 = time.perf_counter()
            params = [p.data for p in self._get_params().values()]
            warn_if_expandable_segments(params)
            changes = self._registrations.sync(params)
            self._registered_layout = None
            self._forget_params()
            self._want_registered = True
            dt = time.perf_counter() - t0
        logger.info(
            "[RDT] registered %d parameter storages (%.1f MiB) with NIXL in %.3f s",
            len(self._registrations), self._registrations.nbytes / 2**20, dt,
        )
        return {
            "registered": True,
            "new_registrations": changes["added"],
            "dropped_stale_registrations": changes["dropped"],
            "registrations": len(self._registrations),
            "bytes": self._registrations.nbytes,
            "seconds": dt,
        }

    def deregister(self) -> int:
        with self._lock:
            self._want_registered = False
            return self._release_registrations()

    def _release_registrations(self) -> int:
        self._registered_layout = None
        self._forget_params()
        if self._registrations is None:
            return 0
        n = self._registrations.release_all()
        if n:
            logger.info("[RDT] released %d NIXL registrations", n)
        return n

    # Memory saver: storage keeps its address but loses its pages; a
    # registration must not outlive the pages it describes.
    def on_weights_released(self) -> None:
        with self._lock:
            self._weights_released = True
            self._release_registrations()

    def on_weights_resumed(self) -> None:
        with self._lock:
            self._weights_released = False
            self._registered_layout = None
            self._forget_params()
            if self._want_registered and self._registrations is not None:
                self._registrations.sync([p.data for p in self._get_params().values()])
                logger.info(
                    "[RDT] re-registered %d parameter storages after resume",
                    len(self._registrations),
                )

    def close(self) -> None:
        """Release registrations (and cached IPC mappings); refuse later pulls."""
        self.deregister()
        with self._lock:
            self._closed = True
        close_cached_mappings()

    def end_of_update(self) -> None:
        """An update is over: the trainer may now free or re-use what it put,
        so no cached mapping of its memory may be read from again — except
        buffers their sender declared persistent (``WeightSyncClient``'s
        buckets), which it releases through :meth:`release_sender` first.

        The update's post-load processing (which ran just before) may have
        moved or replaced parameters: the next pull walks the model again and
        keeps the pull plans only if every parameter is still the same object
        (each plan also checks its targets' storage on every use)."""
        with self._lock:
            self._params_stale = True
        close_cached_mappings(keep_persistent=True)

    def _forget_params(self) -> None:
        """Walk the model again at the next pull and plan every layout anew."""
        self._params = None
        self._params_stale = False
        self._plans.clear()

    def release_sender(self, sender: Optional[str] = None) -> int:
        """Close the cached mappings of one sender's memory (all: ``None``)."""
        n = close_cached_mappings(sender=sender) if sender is not None else close_cached_mappings()
        if n:
            logger.info("[RDT] closed %d cached CUDA IPC mappings of sender %s", n, sender or "(all)")
        return n

    @property
    def registered(self) -> bool:
        return bool(self._registrations)

    def status(self) -> Dict[str, Any]:
        """Registration facts plus the update state's status."""
        return {
            **self.state.status(),
            "registered": self.registered,
            "registrations": len(self._registrations or ()),
            "weights_released": self._weights_released,
            "registration_disabled_reason": self._registration_disabled_reason,
        }

    # ------------------------------------------------------------------ #
    # Pull
    # ------------------------------------------------------------------ #
    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("the engine is shut down; this rank accepts no more pulls")

    def _bind_device(self) -> None:
        # Ray runs actor methods on threads other than the one that set the
        # device; CUDA's current device is per thread.
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def pull(
        self,
        weights_refs: Sequence[Any],
        param_names,
        timeout_s: Optional[float] = None,
    ) -> Dict[str, Any]:
        import ray

        timeout_s = self.pull_timeout_s if timeout_s is None else float(timeout_s)
        if weights_refs is None or isinstance(weights_refs, ray.ObjectRef):
            raise WeightSyncError(
                "weights_refs must be a list of refs: pull_weights.remote([ref], names)"
            )
        refs = list(weights_refs)
        if not refs:
            raise WeightSyncError("empty pull: no refs were given")
        with self._lock:
            self._check_open()
            if self._weights_released:
                raise WeightSyncError(
                    "weights are released (memory saver); resume memory occupation "
                    "before pulling"
                )
            self._bind_device()
            clock = time.perf_counter
            t0 = mark = clock()
            stages: Dict[str, float] = {}

            def lap(stage: str) -> None:
                nonlocal mark
                now = clock()
                stages[stage] = now - mark
                mark = now

            specs = [ref_tensor_specs(r, timeout_s) for r in refs]
            lap("metadata")
            names = group_names(param_names, [len(s) for s in specs])
            targets, walked, reused = self._plan(specs, names)
            lap("plan")
            if self._want_registered and self._registrations is not None:
                self._sync_registrations(targets, walked, reused)
            warn_if_expandable_segments([t for ts in targets for t in ts])
            lap("registration")
            nbytes = sum(t.numel() * t.element_size() for ts in targets for t in ts)
            ntensors = sum(len(ts) for ts in targets)
            writes = [(ns, ref_writer(r)) for ns, r in zip(names, refs)]
            self.state.admit(writes)  # no parameter written by two writers
            lap("admit")
            t_plan = time.perf_counter() - t0
            all_names = [n for ns in names for n in ns]

            from ray.experimental import set_target_for_ref

            # `targets` stays referenced here until ray.get returns: Ray's own
            # references to it are weak.
            for ref, ts in zip(refs, targets):
                set_target_for_ref(ref, ts)
            lap("set_target")
            t1 = time.perf_counter()
            try:
                results = ray.get(refs, timeout=timeout_s)
            except BaseException as e:
                reason = (
                    f"a pull of {ntensors} tensors failed mid-transfer after "
                    f"{time.perf_counter() - t1:.2f} s ({type(e).__name__}); some "
                    "parameters may hold new bytes and others old ones"
                )
                self.state.transfer_failed(all_names, reason)
                self._forget_params()
                logger.error("[RDT] %s: %s", reason, e)
                raise WeightsInconsistentError(
                    f"{reason}. The engine reports its weights as inconsistent until a "
                    f"complete update ends. Cause: {type(e).__name__}: {e}"
                ) from e
            t_fetch = time.perf_counter() - t1
            lap("transfer")
            transports = sorted({transport_used(r) for r in refs})
            problem = self._check_in_place(results, targets, names)
            del results
            if problem is not None:
                self.state.transfer_failed(all_names, problem)
                self._forget_params()
                raise WeightsInconsistentError(problem)
            lap("verify")
            seconds = time.perf_counter() - t0

        stats = {
            "tensors": ntensors,
            "bytes": nbytes,
            "seconds": seconds,
            "fetch_seconds": t_fetch,
            "plan_seconds": t_plan,
            "gbps": nbytes / t_fetch / 1e9 if t_fetch > 0 else float("inf"),
            "refs": len(refs),
            "transports": transports,
            "transport": ",".join(transports),
            "registered": self.registered,
            "plan_reused": reused,
            # Where the call's time went (seconds per stage), and when the
            # pull began and ended on this host's monotonic clock
            # (time.perf_counter: comparable across processes of one host).
            "stages": stages,
            "timing": {"pull_start": t0},
        }
        self.state.landed(writes, stats)
        lap("record")
        # One INFO line per new layout (its first pull); a pull repeating a
        # planned layout logs at DEBUG: the update's INFO line has the totals.
        logger.log(
            logging.DEBUG if reused else logging.INFO,
            "[RDT] pulled %d tensors, %.1f MiB in %.3f s (%.2f GB/s, transport=%s, registered=%s)",
            ntensors, nbytes / 2**20, t_fetch, stats["gbps"], stats["transport"], self.registered,
        )
        lap("log")
        stats["timing"]["pull_end"] = mark
        return stats

    def _plan(self, specs, names) -> "tuple[List[List[torch.Tensor]], bool, bool]":
        """The targets of a pull, whether the model was walked for them, and
        whether a plan was reused.

        A layout (names, shapes, dtypes) seen before reuses its plan when
        every target parameter is still at the address and in the layout it
        was planned with; anything else is checked in full by
        :func:`plan_pull` against the parameter map. That map is one walk of
        the model, taken at the first pull and again at the first pull after
        anything that may move parameters: after the end of an update (its
        post-load processing ran) the plans survive the new walk only if it
        finds the same parameter objects; memory release/resume,
        (de)registration and a failed pull drop them.
        """
        walked = False
        if self._params_stale:
            # After an update's post-load processing: the plans stay only if
            # the walk finds the very same parameter objects.
            fresh = self._get_params()
            old, self._params_stale = self._params, False
            if old is None or fresh.keys() != old.keys() or any(
                fresh[n] is not old[n] for n in fresh
            ):
                self._plans.clear()
            self._params, walked = fresh, True
        key = (tuple(tuple(ns) for ns in names), tuple(tuple(ss) for ss in specs))
        plan = self._plans.get(key)
        if plan is not None:
            if plan.still_live():
                return plan.targets, walked, True
            self._forget_params()  # something moved under us: start over
        if self._params is None:
            self._params, walked = self._get_params(), True
        targets = plan_pull(specs, names, self._params)
        if len(self._plans) >= MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[key] = _Plan(
            targets, [self._params[n] for ns in names for n in ns]
        )
        return targets, walked, False

    def _sync_registrations(self, targets, walked: bool, reused: bool) -> None:
        """Keep the NIXL registrations on the parameters' current storage.

        After a fresh walk: compare every parameter's (address, size) with
        the last sync (post-load processing may have re-allocated any of
        them). Otherwise only this pull's targets need to be covered: a
        reused plan's targets did not move since they were covered
        (``_Plan.still_live``; any change of the registrations drops the
        plans), a new plan's are looked up in the registration book.
        """
        book = self._registrations
        if not walked and (reused or all(book.covers(t) for ts in targets for t in ts)):
            return
        params = self._params if self._params is not None else self._get_params()
        layout = [(p.data_ptr(), p.numel()) for p in params.values()]
        if layout != self._registered_layout:
            book.sync([p.data for p in params.values()])
            self._registered_layout = layout

    @staticmethod
    def _check_in_place(results, targets, names) -> Optional[str]:
        """None when every fetched tensor *is* its target, else what went wrong."""
        for ref_idx, (got, want, ns) in enumerate(zip(results, targets, names)):
            got = list(got) if isinstance(got, (list, tuple)) else [got]
            if len(got) != len(want):
                return f"ref {ref_idx} returned {len(got)} tensors for {len(want)} targets"
            for g, w, n in zip(got, want, ns):
                if not isinstance(g, torch.Tensor) or g.data_ptr() != w.data_ptr():
                    # Ray fetched into a buffer of its own: the model did not change
                    # (or changed only partly if other tensors did land).
                    return (
                        f"{n!r} was fetched into a new buffer instead of the live "
                        "parameter (target dropped by Ray?); the model was not updated "
                        "in place"
                    )
        return None
