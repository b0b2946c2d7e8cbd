"""The receiving side of RDT weight sync: NIXL writes straight into live parameters.

:class:`RdtWeightReceiver` is what a SchedulerActor's ``pull_weights`` runs. It
is independent of the scheduler (it gets the parameters from a callable), so it
is tested in a plain Ray actor around a toy model as well as in a real server.

A pull:

1. reads the tensor metadata (shape, dtype) of every ref without fetching;
2. checks every name, shape, dtype and contiguity against the live parameters
   (:func:`sglang.srt.ray.rdt.engine.plan.plan_pull`) — a rejected pull moves no byte;
3. points ``ray.experimental.set_target_for_ref`` at the parameters' storage and
   keeps the target lists alive until ``ray.get`` returns (Ray holds only weak
   references: if the targets die, Ray silently allocates fresh tensors and the
   model is not updated);
4. fetches all refs with one bounded ``ray.get`` and checks that every returned
   tensor *is* its target (same data pointer) — otherwise the pull fails loudly.

Before step 3 the rank's :class:`~sglang.srt.ray.rdt.engine.update_state.RankUpdateState`
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

from sglang.srt.ray.rdt import gc_pause
from sglang.srt.ray.rdt.defaults import PULL_TIMEOUT_S
from sglang.srt.ray.rdt.engine.nixl_traps import NixlTrapWarnings
from sglang.srt.ray.rdt.engine.refs import (
    cuda_ipc_ref,
    direct_fetch,
    fetch_same_node,
    nixl_job,
    note_nixl_read,
    ref_tensor_specs,
    ref_writer,
    transport_used,
)
from sglang.srt.ray.rdt.engine.registration import (
    ParameterRegistration,
    RegistrationBook,
    close_cached_mappings,
    warn_if_expandable_segments,
)
from sglang.srt.ray.rdt.engine.update_state import RankUpdateState
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError
from sglang.srt.ray.rdt.transport import compat, nixl_reader
from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread
from sglang.srt.ray.rdt.engine.plan import PlanCache, TensorSpec, check_in_place, group_names

logger = logging.getLogger(__name__)

GC_HOLDER = "rank weight update"
# Refs whose tensor specs a rank keeps (_specs): the last few layouts' refs.
MAX_KEPT_SPECS = 64

PARAMS_MOVED = (
    "the rollout model's parameters changed since this layout was planned (a "
    "parameter was re-allocated or re-viewed while no update's end and no sglang "
    "weight load announced it)"
)


class ParametersMoved(WeightSyncError):
    """A reused plan's targets are no longer the live parameters."""

    def __init__(self, written: bool):
        super().__init__(PARAMS_MOVED)
        self.written = written


class RdtWeightReceiver:
    """Pull RDT refs into the live parameters returned by ``get_params``."""

    def __init__(
        self,
        get_params: Callable[[], Mapping[str, torch.Tensor]],
        *,
        device: Optional[torch.device] = None,
        pull_timeout_s: float = PULL_TIMEOUT_S,
        registration_disabled_reason: Optional[str] = None,
        registrations: Optional[RegistrationBook] = None,
        state: Optional[RankUpdateState] = None,
    ):
        # Before this process's NIXL agent exists: its progress thread must
        # not spin a core for the life of the rank (see nixl_progress).
        configure_nixl_progress_thread()
        self._get_params = get_params
        self._device = device
        self._nixl_traps = NixlTrapWarnings(device)  # writers told about a slow NIXL path
        self.pull_timeout_s = pull_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._weights_released = False
        # The live parameters as one walk of the model found them, and the
        # pull plans made against them (when they are trusted, checked
        # again, or dropped: PlanCache).
        self._plans = PlanCache(get_params)
        self._ref_specs: Dict[str, List[TensorSpec]] = {}  # by ref id (_specs)
        self._registration = ParameterRegistration(get_params, self._plans,
                                                   registration_disabled_reason, registrations)
        # What updates wrote, consistency and counters (the rank's one owner).
        self.state = state or RankUpdateState(param_names=lambda: list(get_params()))

    # ------------------------------------------------------------------ #
    # Registration
    # ------------------------------------------------------------------ #
    def register(self) -> Dict[str, Any]:
        reason = self._registration.disabled_reason
        if reason:
            logger.info("[RDT] register_weight_for_rdt skipped: %s", reason)
            return {"registered": False, "reason": reason}
        with self._lock:
            self._check_open()
            self._bind_device()
            if self._weights_released:
                raise WeightSyncError(
                    "weights are released (memory saver); resume memory occupation first"
                )
            t0 = time.perf_counter()
            changes = self._registration.register()
            dt = time.perf_counter() - t0
        book = self._registration.book
        logger.info("[RDT] registered %d parameter storages (%.1f MiB) with NIXL in %.3f s",
                    len(book), book.nbytes / 2**20, dt)
        return {
            "registered": True,
            "new_registrations": changes["added"],
            "dropped_stale_registrations": changes["dropped"],
            "registrations": len(book),
            "bytes": book.nbytes,
            "seconds": dt,
        }

    def deregister(self) -> int:
        with self._lock:
            self._registration.wanted = False
            return self._registration.release()

    # Memory saver: storage keeps its address but loses its pages; a
    # registration must not outlive the pages it describes.
    def on_weights_released(self) -> None:
        with self._lock:
            self._weights_released = True
            self._registration.release()

    def on_weights_resumed(self) -> None:
        with self._lock:
            self._weights_released = False
            self._registration.resumed()

    def close(self) -> None:
        """Release registrations (and cached IPC mappings); refuse later pulls."""
        self.deregister()
        with self._lock:
            self._closed = True
        close_cached_mappings()
        nixl_reader.reader().release()
        gc_pause.resume(GC_HOLDER)

    def end_of_update(self, resume_gc: bool = True) -> None:
        """An update is over: the trainer may now free or re-use what it put,
        so no cached mapping of its memory may be read from again — except
        buffers their sender declared persistent (``WeightSyncClient``'s
        buckets), which it releases through :meth:`release_sender` first.

        The update's post-load processing (which ran just before) may have
        moved or replaced parameters: the next pull walks the model again and
        keeps the pull plans only if every parameter is still the same object
        (each plan also checks its targets' storage on every use).

        ``resume_gc=False`` (a rank that stays paused for the next update)
        keeps automatic garbage collection off until :meth:`release_gc`
        (see :mod:`sglang.srt.ray.rdt.gc_pause`)."""
        with self._lock:
            self._plans.mark_stale()
        close_cached_mappings(keep_persistent=True)
        if resume_gc or gc_pause.held_for(GC_HOLDER) > gc_pause.MAX_HOLD_S:
            gc_pause.resume(GC_HOLDER)  # the collector runs again outside updates

    def on_weights_loaded(self) -> None:
        """sglang loaded weights its own way (``update_weights_from_*``): its
        post-load processing may have replaced parameters, so the next pull
        walks the model first (plans survive for the same parameter objects)."""
        with self._lock:
            self._plans.mark_stale()

    def needs_refresh(self) -> bool:
        """Whether the next pull would walk the model first (an update ended)."""
        return self._plans.stale

    def refresh(self) -> bool:
        """Do now what the first pull after an update's end does before it
        plans (scheduler thread): walk the model, keep the plans of
        unreplaced parameters, bring the NIXL registrations onto the
        parameters' storage. Run once the update's answer has left, it takes
        that work off the next update's critical path (every plan is still
        checked against its targets at each pull). Returns whether it walked."""
        with self._lock:
            if self._closed or self._weights_released:
                return False
            walked = self._plans.refresh()
            if walked:
                self._registration.after_walk()
            return walked

    @staticmethod
    def release_gc() -> None:
        """Generation continues: the collector may run again."""
        gc_pause.resume(GC_HOLDER)

    def _forget_params(self) -> None:
        """Walk the model again at the next pull and plan every layout anew."""
        self._plans.forget()

    def release_sender(self, sender: Optional[str] = None) -> int:
        """Close the cached mappings of one sender's memory (all: ``None``)."""
        n = close_cached_mappings(sender=sender) if sender is not None else close_cached_mappings()
        if n:
            logger.info("[RDT] closed %d cached CUDA IPC mappings of sender %s", n, sender or "(all)")
        return n

    @property
    def registered(self) -> bool:
        return bool(self._registration.book)

    def status(self) -> Dict[str, Any]:
        """Registration facts plus the update state's status."""
        return {
            **self.state.status(),
            "registered": self.registered,
            "registrations": len(self._registration),
            "weights_released": self._weights_released,
            "registration_disabled_reason": self._registration.disabled_reason,
            "nixl_reads": nixl_reader.reader().status(),
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

    def _specs(self, ref, timeout_s: float) -> List[TensorSpec]:
        """A ref's tensor specs; kept per ref (they never change), so a ref
        pulled again — a zero-copy trainer's kept ref — is not read again."""
        key = ref.hex() if hasattr(ref, "hex") else None
        specs = self._ref_specs.get(key) if key is not None else None
        if specs is None:
            specs = ref_tensor_specs(ref, timeout_s)
            if key is not None:
                if len(self._ref_specs) >= MAX_KEPT_SPECS:
                    self._ref_specs.pop(next(iter(self._ref_specs)))
                self._ref_specs[key] = specs
        return specs

    def param_names(self) -> List[str]:
        """The live parameters' names as the last walk of the model found them."""
        return self._plans.param_names()

    def _enter_pull(self, weights_refs) -> List[Any]:
        """The refs of a pull, after the checks every pull starts with (lock held)."""
        import ray

        if weights_refs is None or isinstance(weights_refs, ray.ObjectRef):
            raise WeightSyncError(
                "weights_refs must be a list of refs: pull_weights.remote([ref], names)"
            )
        refs = list(weights_refs)
        if not refs:
            raise WeightSyncError("empty pull: no refs were given")
        self._check_open()
        if self._weights_released:
            raise WeightSyncError(
                "weights are released (memory saver); resume memory occupation before pulling"
            )
        self._bind_device()
        return refs

    def prepare(self, weights_refs: Sequence[Any], param_names) -> Dict[str, Any]:
        """Everything of a pull of these refs but the bytes: check the names,
        shapes and dtypes, keep the plan, and open what a same-node read needs
        (the sender's CUDA IPC segments mapped, the copies planned). Writes
        nothing, so it needs no pause; the next pull of the same layout from
        the same tensors starts as a steady one."""
        t0 = time.perf_counter()
        with self._lock:
            refs = self._enter_pull(weights_refs)
            specs = [self._specs(r, self.pull_timeout_s) for r in refs]
            names = group_names(param_names, [len(s) for s in specs])
            plan, _, reused = self._plans.plan(specs, names)
            targets = plan.targets
            same_node = sum(fetch_same_node(r, ts, copy=False) is not None
                            for r, ts in zip(refs, targets))
        return {
            "tensors": sum(len(ts) for ts in targets),
            "refs": len(refs),
            "same_node_refs": same_node,  # read without NIXL or ray.get by the pull
            "plan_reused": reused,
            "seconds": time.perf_counter() - t0,
        }

    def pull(
        self,
        weights_refs: Sequence[Any],
        param_names,
        timeout_s: Optional[float] = None,
    ) -> Dict[str, Any]:
        import ray

        timeout_s = self.pull_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            refs = self._enter_pull(weights_refs)
            # No full collection (75-107 ms) inside the update: off from its
            # first pull until end_of_update (gc_pause).
            gc_pause.pause(GC_HOLDER)
            clock = time.perf_counter
            t0 = mark = clock()
            stages: Dict[str, float] = {}

            def lap(stage: str) -> None:
                nonlocal mark
                now = clock()
                stages[stage] = now - mark
                mark = now

            specs = [self._specs(r, timeout_s) for r in refs]
            # Ray's record of each ref, looked up once (after _specs: it may
            # have waited for the transport metadata to arrive)
            metas = [compat.rdt_metadata(r) for r in refs]
            direct = direct_fetch()
            lap("metadata")
            names = group_names(param_names, [len(s) for s in specs])
            # Read over CUDA IPC, a reused plan's targets are checked against
            # the live parameters while the copy engine works (check_live
            # below), not before it starts: the check (~1 us a parameter)
            # then costs nothing. The plan holds its targets' storage, so a
            # copy into a target that stopped being live writes no other
            # memory; the pull then fails and the rank reports itself
            # inconsistent until an update lands.
            defer = all(cuda_ipc_ref(r, m, direct) for r, m in zip(refs, metas))
            plan, walked, reused = self._plans.plan(specs, names, check_live=not defer)
            targets = plan.targets
            unchecked = defer and reused
            lap("plan")
            self._registration.sync_for_pull(targets, walked, reused)
            if not reused:
                warn_if_expandable_segments([t for ts in targets for t in ts])
            lap("registration")
            nbytes, ntensors = plan.nbytes, plan.count
            writes = [(ns, ref_writer(r, m)) for ns, r, m in zip(names, refs, metas)]
            self._nixl_traps.before_pull(refs, writes)
            self.state.admit(writes)  # no parameter written by two writers
            lap("admit")
            t_plan = time.perf_counter() - t0
            all_names = [n for ns in names for n in ns]

            from ray.experimental import set_target_for_ref

            def check_live(written: bool) -> None:
                nonlocal unchecked
                unchecked = False
                if not plan.still_live():
                    raise ParametersMoved(written)

            t1 = time.perf_counter()
            try:
                # Same-node refs are read straight into their targets, NIXL
                # refs through this process's NIXL agent; the rest (and a
                # NIXL read that could not start) through Ray's fetch
                # (ray.get), whose references to the targets are weak:
                # `targets` stays referenced here until it returns.
                results: List[Any] = [None] * len(refs)
                rest, nixl = [], []
                for i, (ref, ts, meta) in enumerate(zip(refs, targets, metas)):
                    # (the first read that starts runs the check during its copy)
                    got = fetch_same_node(ref, ts, while_copying=check_live if unchecked else None,
                                          meta=meta, direct=direct)
                    if got is not None:
                        results[i] = got
                        continue
                    job = nixl_job(ref, ts, meta, direct)
                    if job is None:
                        rest.append(i)
                    else:
                        nixl.append((i, *job))
                if unchecked and (nixl or rest):
                    check_live(written=False)  # before another path writes anything
                if nixl:
                    t_nixl = time.perf_counter()
                    read = nixl_reader.read([job for _, job, _ in nixl], timeout_s)
                    t_nixl = time.perf_counter() - t_nixl
                    for (i, _, why), got in zip(nixl, read):
                        if got is None:
                            rest.append(i)
                        else:
                            results[i] = got
                            if why is not None:  # an SGLANG_IPC ref read through its NIXL part
                                note_nixl_read(refs[i], why, got, t_nixl)
                lap("direct")
                if rest:
                    for i in rest:
                        set_target_for_ref(refs[i], targets[i])
                    fetched = ray.get([refs[i] for i in rest], timeout=timeout_s)
                    for i, got in zip(rest, fetched):
                        results[i] = got
            except BaseException as e:
                if isinstance(e, ParametersMoved) and not e.written:
                    self._forget_params()  # planned afresh by the next pull
                    raise WeightSyncError(
                        f"{PARAMS_MOVED}; nothing was written. Send the pull again: "
                        "it is planned against the parameters as they are now"
                    ) from None
                reason = (
                    f"a pull of {ntensors} tensors failed mid-transfer after "
                    f"{time.perf_counter() - t1:.2f} s ({type(e).__name__}); some "
                    "parameters may hold new bytes and others old ones"
                )
                self.state.transfer_failed(all_names, reason)
                self._forget_params()
                # The collector runs again from here: the failed transfer's
                # objects (Ray/NIXL transfer handles held by the exception's
                # traceback cycles) must be freed as usual. Held until the
                # update ended, their release crashed the rank in
                # nixlAgent::releaseXferReq (2 of 2 runs; 0 of 2 without).
                gc_pause.resume(GC_HOLDER)
                logger.error("[RDT] %s: %s", reason, e)
                raise WeightsInconsistentError(
                    f"{reason}. The engine reports its weights as inconsistent until a "
                    f"complete update ends. Cause: {type(e).__name__}: {e}"
                ) from e
            t_fetch = time.perf_counter() - t1
            lap("transfer")
            transports = sorted({transport_used(r, m) for r, m in zip(refs, metas)})
            if "nixl" in transports:
                self._nixl_traps.after_pull(nbytes, t_fetch, writes)
            problem = check_in_place(results, targets, names)
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
            # refs read without ray.get (same-node path, or NIXL directly)
            "direct_refs": len(refs) - len(rest),
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
