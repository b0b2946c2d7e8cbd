"""The weight-sync methods of a SchedulerActor.

``SchedulerActor`` inherits :class:`RdtWeightSyncMixin`; with
``--enable-rdt-weight-sync`` a trainer (usually in another Ray job) calls:

``register_weight_for_rdt()``
    Pin the model's parameters with NIXL once, so pulls skip registration.
``pull_weights(weights_refs, param_names, timeout=None)``
    Write the tensors behind RDT refs straight into live parameters.

The update around the pulls is sglang's own lifecycle, over HTTP (what miles
does: ``/pause_generation``, ``/begin_weight_update``, pulls,
``/update_weight_version``, ``/end_weight_update``, ``/continue_generation``)
or as actor calls: ``begin_weight_update()``,
``finalize_weight_update(weight_version=None, flush_cache=True)`` (version,
``end_weight_update``, flush) and ``abort_weight_update(reason)``. Whichever
path drives it, the scheduler tells this rank's
:class:`~sglang.srt.ray.rdt.update_state.RankUpdateState` (the one owner of
the update's state) through its weight listeners. For anyone:
``get_weight_sync_status()``, ``get_weight_sync_stats()`` (per-update
figures) and ``get_parallelism_config()``.

Torn weights: a pull is refused unless this rank is quiesced — generation is
paused (``/pause_generation``, any mode) or a weight-update session is open —
and no batch is running. Pulls, begin and finalize run on the scheduler's own
thread at a safe point between loop iterations
(:mod:`sglang.srt.managers.scheduler_safe_point`), never beside a forward pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Sequence

import torch

from sglang.srt.managers.scheduler_safe_point import (
    SafePointQueue,
    wake_idle_sleeper_on_tasks,
    weight_update_session_open,
)
from sglang.srt.ray.rdt import metrics as rdt_metrics
from sglang.srt.ray.rdt.errors import (
    WeightsInconsistentError,
    WeightSyncError,
    WeightUpdateConflictError,
)
from sglang.srt.ray.rdt.update_state import RankUpdateState

logger = logging.getLogger(__name__)

# How long a call waits for the scheduler loop to reach a safe point.
SAFE_POINT_TIMEOUT_S = 120.0
# How long a pull waits for a pause that is on its way to the scheduler.
PAUSE_GRACE_S = 1.0
NOT_PAUSED = "no weight-update session is open and generation is not paused"
_NOT_PAUSED_YET = object()

NOT_QUIESCED = (
    "refusing to pull weights while generation may run on this rank: {why}. "
    "Pause generation first — POST /pause_generation (mode abort, retract or "
    "in_place), then POST /begin_weight_update; POST /weight_sync/begin, "
    "RayEngine.begin_weight_sync() and WeightSyncClient.update() drain in-flight "
    "requests and hold new ones instead — and end the update with "
    "POST /end_weight_update and /continue_generation."
)


def failure_kind(exc: BaseException) -> Optional[str]:
    """The failure ``kind`` of a failed pull that the update state has not
    counted itself (it counts conflicts and broken transfers)."""
    if isinstance(exc, (WeightsInconsistentError, WeightUpdateConflictError)):
        return None
    if isinstance(exc, WeightSyncError):
        return "rejected"
    return "other"


def _is_quiesced(scheduler) -> Optional[str]:
    """None when a pull is safe now, else why not."""
    session_open = weight_update_session_open(scheduler)
    paused = bool(getattr(scheduler, "_engine_paused", False))
    if not (session_open or paused):
        return NOT_PAUSED
    try:
        idle = scheduler.is_fully_idle(ignore_waiting=True)
    except Exception as e:  # pragma: no cover - defensive
        return f"could not tell whether a batch is running ({e})"
    if not idle:
        return "a batch is still running (paused in place?)"
    return None


def run_post_load(scheduler) -> None:
    """The model's post-load processing on every runner (what sglang's
    end_weight_update does when a session made the pulls)."""
    for _, runner in scheduler.weight_updater._select_runners("all"):
        runner.weight_updater.end_weight_update(run_post_load=True)


class _RankListener:
    """The scheduler's weight events, forwarded to this rank's state and receiver."""

    def __init__(self, actor: "RdtWeightSyncMixin"):
        self._actor = actor

    def on_weights_released(self) -> None:
        self._actor._rdt_receiver.on_weights_released()

    def on_weights_resumed(self) -> None:
        self._actor._rdt_receiver.on_weights_resumed()

    def on_weight_update_begin(self) -> None:
        self._actor._rdt_state.begin()

    def on_weight_update_end(self) -> Optional[str]:
        if not self._actor._rdt_state.update_open:
            return None  # aborted: abort_weight_update closed it already
        return self._actor._on_update_end()

    def on_generation_continued(self) -> None:
        state = self._actor._rdt_state
        if state.update_kind == "paused":
            # Pulls under a plain pause that nobody finalized: the weights
            # are live now, so they get their post-load processing here.
            scheduler = self._actor.scheduler
            logger.info("[RDT] continue_generation ends the update made under the pause")
            self._actor._end_paused_update(scheduler)


class RdtWeightSyncMixin:
    """Mixed into SchedulerActor; all state lives under ``_rdt_*`` names."""

    def _init_weight_sync(self, server_args, gpu_id: int) -> None:
        from sglang.srt.runtime_context import get_device

        self._rdt_enabled = bool(getattr(server_args, "enable_rdt_weight_sync", False))
        self._rdt_receiver = None
        self._rdt_gpu_id = gpu_id
        self._rdt_device = get_device().device
        self._rdt_safe_point = SafePointQueue()
        self.scheduler.safe_point_tasks = self._rdt_safe_point
        self._rdt_idle_sleep = "off"
        if getattr(self.scheduler, "idle_sleeper", None) is not None:
            # --sleep-on-idle: a queued pull or finalize wakes the loop at once
            # instead of after its poll timeout (up to 1 s per call).
            if wake_idle_sleeper_on_tasks(self.scheduler, self._rdt_safe_point):
                self._rdt_idle_sleep = "wakes on weight-sync calls"
            else:
                self._rdt_idle_sleep = "weight-sync calls wait for its timeout"
                logger.info("[RDT] --sleep-on-idle: weight-sync calls wait for the idle sleeper's timeout")
        from sglang.srt.ray.lifecycle import watch_owner_job

        watch_owner_job(self._exit_orphaned)
        if not self._rdt_enabled:
            return
        from sglang.srt.ray.rdt.receiver import RdtWeightReceiver

        model_runner = self.scheduler.tp_worker.model_runner
        device = (
            torch.device("cuda", gpu_id) if self._rdt_device == "cuda" else None
        )
        reason = None
        if getattr(server_args, "enable_memory_saver", False):
            reason = (
                "--enable-memory-saver: parameter storage is released and re-mapped, "
                "so it cannot stay registered; pulls register per call instead"
            )
        self._rdt_rank_label = self._rank_labels()
        self._rdt_flush_at_end = True  # finalize_weight_update(flush_cache=False) clears it
        self._rdt_state = RankUpdateState(
            param_names=lambda: [n for n, _ in model_runner.model.named_parameters()],
            rank=self._rank_text(),
            weight_version=self._weight_version,
        )
        self._rdt_receiver = RdtWeightReceiver(
            lambda: dict(model_runner.model.named_parameters()),
            device=device,
            pull_timeout_s=float(getattr(server_args, "rdt_pull_timeout", 60.0)),
            registration_disabled_reason=reason,
            state=self._rdt_state,
        )
        rdt_metrics.configure(
            bool(getattr(server_args, "enable_metrics", False)), self._rdt_rank_label
        )
        from sglang.srt.managers.weight_listeners import add_weight_listener

        add_weight_listener(self.scheduler, _RankListener(self))
        # The same-node fast path (CUDA IPC for GPUs, process_vm_readv for
        # CPU memory); Ray pushes custom transports to new actors
        # asynchronously, so register it here ourselves.
        self._rdt_transports = ["NIXL"]
        try:
            from sglang.srt.ray.rdt import cuda_ipc_transport

            self._rdt_transports.append(cuda_ipc_transport.register())
        except Exception as e:
            logger.warning("[RDT] same-node fast path unavailable, NIXL only: %s", e)

    def _rank_labels(self) -> Dict[str, str]:
        try:
            cfg = self.get_parallelism_config()
        except Exception:  # pragma: no cover - the runtime context is published first
            cfg = {}
        return {
            "dp_rank": str(cfg.get("dp_rank") or 0),
            "pp_rank": str(cfg.get("pp_rank") or 0),
            "tp_rank": str(cfg.get("tp_rank") or 0),
        }

    def _exit_orphaned(self, why: str) -> None:
        import ray

        logger.error("[RDT] %s; this detached scheduler actor exits", why)
        try:
            self.shutdown_weight_sync()
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ------------------------------------------------------------------ #
    def _receiver(self):
        if not self._rdt_enabled:
            raise WeightSyncError(
                "RDT weight sync is off on this engine: start it with "
                "--enable-rdt-weight-sync (and --backend ray)"
            )
        return self._rdt_receiver

    def _on_scheduler(self, fn, timeout_s: float = SAFE_POINT_TIMEOUT_S):
        return self._rdt_safe_point.call(self.scheduler, fn, timeout_s)

    # ------------------------------------------------------------------ #
    # Public actor API
    # ------------------------------------------------------------------ #
    def register_weight_for_rdt(self) -> Dict[str, Any]:
        """Register every parameter's storage with NIXL once (idempotent).

        Later pulls then skip memory registration. Returns
        ``{"registered": bool, ...}``; with ``--enable-memory-saver`` nothing is
        registered and ``reason`` says why.
        """
        return self._receiver().register()

    def pull_weights(
        self,
        weights_refs: Sequence[Any],
        param_names,
        timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Fetch RDT refs straight into this rank's live parameters.

        Args:
            weights_refs: list of refs, each from ``ray.put(list_of_tensors,
                _tensor_transport="nixl")`` in the trainer. Pass them nested
                (``pull_weights.remote([ref], names)``) so Ray hands over the
                refs, not their values.
            param_names: the parameter name of every tensor — one flat list in
                the refs' order (miles' shape) or one list per ref. Names are
                this rank's ``model.named_parameters()`` names; tensors must be
                in its layout (dtype, shape of its TP shard).
            timeout: seconds for the transfer (default ``rdt_pull_timeout``).

        Returns: ``{"tensors", "bytes", "seconds", "gbps", ...}``.

        Raises ``WeightSyncError`` before any byte moves for a bad call (names,
        shapes, dtypes, refs), or when generation may be running;
        ``WeightUpdateConflictError`` before any byte moves when another
        writer already wrote one of the parameters in this update;
        ``WeightsInconsistentError`` when a transfer broke mid-way.
        """
        receiver = self._receiver()

        def run(scheduler):
            why = _is_quiesced(scheduler)
            if why is None:
                return receiver.pull(weights_refs, param_names, timeout)
            if why == NOT_PAUSED:
                return _NOT_PAUSED_YET  # maybe the pause is still on its way
            raise WeightSyncError(NOT_QUIESCED.format(why=why))

        budget = (timeout or receiver.pull_timeout_s) + SAFE_POINT_TIMEOUT_S
        try:
            # A /pause_generation that returned has been sent to this rank,
            # but the scheduler may take it in one loop iteration after this
            # call reached its safe point: look again for a moment first.
            deadline = time.monotonic() + PAUSE_GRACE_S
            while True:
                out = self._on_scheduler(run, budget)
                if out is not _NOT_PAUSED_YET:
                    return out
                if time.monotonic() > deadline:
                    raise WeightSyncError(NOT_QUIESCED.format(why=NOT_PAUSED))
                time.sleep(0.01)
        except BaseException as e:
            kind = failure_kind(e)
            if kind is not None:
                self._rdt_state.fail(kind)
            raise

    def begin_weight_update(self) -> Dict[str, Any]:
        """Open sglang's weight-update session on this rank (what
        ``POST /begin_weight_update`` does for every rank)."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._receiver()

        def run(scheduler):
            out = scheduler.weight_updater.begin_weight_update(BeginWeightUpdateReqInput())
            if not out.success:
                raise WeightSyncError(f"begin_weight_update failed: {out.message}")
            return {"success": True}

        return self._on_scheduler(run)

    def finalize_weight_update(
        self, weight_version: Optional[str] = None, flush_cache: bool = True
    ) -> Dict[str, Any]:
        """End the update on this rank: version, post-load processing, flush.

        The actor-call spelling of ``/update_weight_version`` +
        ``/end_weight_update`` (+ a cache flush: its KV was computed with the
        old weights). Without an open session (the caller only paused
        generation), it runs the model's post-load processing itself. Call it
        once per update, after every rank's pulls returned. Raises
        ``WeightSyncError`` with the rank's message when the update was not a
        clean one (a broken transfer, two writers of one parameter).
        """
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self._receiver()

        def run(scheduler):
            if weight_version is not None:
                scheduler.record_weight_version_change(new_version=str(weight_version))
            self._rdt_flush_at_end = flush_cache
            try:
                if weight_update_session_open(scheduler):
                    out = scheduler.weight_updater.end_weight_update(EndWeightUpdateReqInput())
                    problem = None if out.success else out.message
                else:
                    why = _is_quiesced(scheduler)
                    if why is not None:
                        raise WeightSyncError(
                            "refusing to finalize while generation may run: " + why
                        )
                    problem = self._end_paused_update(scheduler)
            finally:
                self._rdt_flush_at_end = True
            last = self._rdt_state.last_update or {}
            flushed = last.get("flushed_cache", False)
            if flush_cache and not flushed:
                flushed = scheduler.flush_cache()
            if problem:
                raise WeightSyncError(f"the update ended inconsistent: {problem}")
            return {
                "success": True,
                "flushed_cache": bool(flushed),
                "weight_version": self._weight_version(),
                "update": self._rdt_state.last_update,
            }

        try:
            return self._on_scheduler(run)
        except WeightSyncError:
            raise
        except BaseException:
            self._rdt_state.fail("finalize")
            raise

    def _end_paused_update(self, scheduler) -> Optional[str]:
        """Close an update made under a plain pause (no session): the model's
        post-load processing, then the update state's end."""
        run_post_load(scheduler)
        return self._on_update_end()

    def _on_update_end(self) -> Optional[str]:
        extra = {}
        if self._rdt_flush_at_end and self._rdt_state.wrote_weights:
            # KV in the prefix cache was computed with the old weights; the
            # engine is paused, so nothing can be using it.
            extra["flushed_cache"] = bool(self.scheduler.flush_cache())
            if not extra["flushed_cache"]:
                logger.warning("[RDT] the prefix cache could not be flushed after the update; "
                               "call /flush_cache before generation continues")
        summary = self._rdt_state.end(**extra)
        self._rdt_receiver.end_of_update()
        if summary["consistent"]:
            return None
        return summary["inconsistent_reason"]

    def _rank_text(self) -> str:
        r = self._rdt_rank_label
        return f"dp{r['dp_rank']}/pp{r['pp_rank']}/tp{r['tp_rank']}"

    def abort_weight_update(self, reason: str = "update aborted") -> Dict[str, Any]:
        """Close the update without a version bump.

        If any pull ran in it, this rank reports its weights as inconsistent
        until a later clean update ends.
        """
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        receiver = self._receiver()

        def run(scheduler):
            status = self._rdt_state.abort(reason)  # first: end is then a no-op
            if weight_update_session_open(scheduler):
                scheduler.weight_updater.end_weight_update(EndWeightUpdateReqInput())
            receiver.end_of_update()
            return status

        return self._on_scheduler(run)

    def get_weight_sync_status(self) -> Dict[str, Any]:
        """Consistency, the update in progress, registration and counters."""
        status = {"enabled": self._rdt_enabled, "weight_version": self._weight_version()}
        if self._rdt_receiver is not None:
            status.update(self._rdt_receiver.status())
            status["transports"] = list(self._rdt_transports)
            from sglang.srt.ray.rdt import nixl_progress

            status["nixl_progress_thread"] = nixl_progress.describe()
        status["event_loop"] = self._rdt_safe_point.state
        status["idle_sleep"] = self._rdt_idle_sleep
        return status

    def get_weight_sync_stats(self) -> Dict[str, Any]:
        """Per-update figures of this rank: ``last_update`` (tensors, bytes,
        seconds, GB/s, transport, writers, parameters updated, weight_version
        — the same as its log line), ``updates``, ``failures`` by kind, the
        pull counters and whether Prometheus metrics are on."""
        self._receiver()
        st = self._rdt_state.status()
        return {
            "updates": st["updates"],
            "failed_updates": st["failed_updates"],
            "failures": st["failures"],
            "last_update": st["last_update"],
            "update_in_progress": st["update_in_progress"],
            "rank": self._rdt_rank_label,
            "weight_version": st["weight_version"],
            "pulls": {k: st[k] for k in ("pulls", "failed_pulls", "tensors", "bytes", "seconds")},
            "last_pull": st["last_pull"],
            "metrics_enabled": rdt_metrics.enabled(),
        }

    def get_parallelism_config(self) -> Dict[str, Any]:
        """This rank's parallel layout (the same record the bootstrap server serves)."""
        from sglang.srt.model_executor.parallelism_config import read_parallelism_config

        return read_parallelism_config(self._rdt_gpu_id, self._rdt_device)

    def get_parameter_checksums(self) -> Dict[str, str]:
        """sha256 of every live parameter's bytes (read on the scheduler thread).

        For checking that an update landed (or that a rejected one changed
        nothing) without moving the weights."""
        import hashlib

        def run(scheduler):
            model = scheduler.tp_worker.model_runner.model
            out = {}
            for name, p in model.named_parameters():
                data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                out[name] = hashlib.sha256(data.tobytes()).hexdigest()
            return out

        return self._on_scheduler(run)

    def get_ray_placement(self) -> Dict[str, Any]:
        """Where Ray put this actor: placement group, node, namespace, job."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "placement_group_id": ctx.get_placement_group_id(),
            "node_id": ctx.get_node_id(),
            "namespace": ctx.namespace,
            "job_id": ctx.get_job_id(),
            "actor_name": ctx.get_actor_name(),
        }

    def get_parameter_layout(self) -> Dict[str, Dict[str, Any]]:
        """``{name: {"shape", "dtype", "data_ptr"}}`` of this rank's live parameters:
        the names, shapes and dtypes ``pull_weights`` expects."""
        model = self.scheduler.tp_worker.model_runner.model
        return {
            name: {
                "shape": list(p.shape),
                "dtype": str(p.dtype).replace("torch.", ""),
                "data_ptr": p.data_ptr(),
            }
            for name, p in model.named_parameters()
        }

    def release_weight_sync_mappings(self, sender_token: Optional[str] = None) -> int:
        """Close this rank's cached CUDA IPC mappings of one trainer process's
        memory (``sender_token``; every sender: ``None``). A trainer calls it
        before it frees buckets it declared persistent (``WeightSyncClient``
        does, on close and when its buckets grow). Returns how many closed."""
        return self._receiver().release_sender(sender_token)

    def shutdown_weight_sync(self) -> int:
        """Release NIXL registrations; later pulls are refused."""
        if self._rdt_receiver is None:
            return 0
        n = self._rdt_receiver.deregister()
        self._rdt_receiver.close()
        return n

    # ------------------------------------------------------------------ #
    @staticmethod
    def _weight_version() -> Optional[str]:
        from sglang.srt.runtime_context import get_serving

        try:
            return get_serving().weight_version
        except Exception:
            return None
