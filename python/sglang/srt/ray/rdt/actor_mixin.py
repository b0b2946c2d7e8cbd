"""The weight-sync methods of a SchedulerActor.

``SchedulerActor`` inherits :class:`RdtWeightSyncMixin`; with
``--enable-rdt-weight-sync`` a trainer (usually in another Ray job) calls:

``register_weight_for_rdt()``
    Pin the model's parameters with NIXL once, so pulls skip registration.
``pull_weights(weights_refs, param_names, timeout=None)``
    Write the tensors behind RDT refs straight into live parameters.
``finalize_weight_update(weight_version=None, flush_cache=True)``
    After all buckets landed: post-load processing, cache flush, version bump.

and, for the engine's own update session (``/weight_sync/*``, ``RayEngine``):
``begin_weight_update()``, ``abort_weight_update()``; for anyone:
``get_weight_sync_status()``, ``get_weight_sync_stats()`` (per-update figures)
and ``get_parallelism_config()``.

Torn weights: a pull is refused unless this rank is quiesced — an update
session is open (which drained in-flight requests and holds new ones back), or
generation is paused — and no batch is running. Pulls, begin and finalize run
on the scheduler's own thread at a safe point between loop iterations
(:mod:`sglang.srt.managers.scheduler_safe_point`), never beside a forward pass.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence

import torch

from sglang.srt.managers.scheduler_safe_point import (
    SafePointQueue,
    wake_idle_sleeper_on_tasks,
)
from sglang.srt.ray.rdt import metrics as rdt_metrics
from sglang.srt.ray.rdt.plan import WeightsInconsistentError, WeightSyncError

logger = logging.getLogger(__name__)

# How long a call waits for the scheduler loop to reach a safe point.
SAFE_POINT_TIMEOUT_S = 120.0

NOT_QUIESCED = (
    "refusing to pull weights while generation may run on this rank: {why}. "
    "Open a weight-update session first — POST /weight_sync/begin, "
    "RayEngine.begin_weight_sync() or WeightSyncClient.update() drain in-flight "
    "requests and hold new ones until the update is finalized — or pause "
    "generation (POST /pause_generation) and let running requests finish."
)

def failure_kind(exc: BaseException) -> str:
    """The metrics ``kind`` of a failed pull."""
    if isinstance(exc, WeightsInconsistentError):
        return "transfer"
    if isinstance(exc, WeightSyncError):
        return "rejected"
    return "other"


def _is_quiesced(scheduler) -> Optional[str]:
    """None when a pull is safe now, else why not."""
    updater = getattr(scheduler, "weight_updater", None)
    session_open = getattr(updater, "_session", None) is not None
    paused = bool(getattr(scheduler, "_engine_paused", False))
    if not (session_open or paused):
        return "no weight-update session is open and generation is not paused"
    try:
        idle = scheduler.is_fully_idle(ignore_waiting=True)
    except Exception as e:  # pragma: no cover - defensive
        return f"could not tell whether a batch is running ({e})"
    if not idle:
        return "a batch is still running (paused in place?)"
    return None


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
        self._rdt_receiver = RdtWeightReceiver(
            lambda: dict(model_runner.model.named_parameters()),
            device=device,
            pull_timeout_s=float(getattr(server_args, "rdt_pull_timeout", 60.0)),
            registration_disabled_reason=reason,
        )
        self._rdt_update_touched = False
        self._rdt_updates = rdt_metrics.UpdateTracker()
        self._rdt_rank_label = self._rank_labels()
        rdt_metrics.configure(
            bool(getattr(server_args, "enable_metrics", False)), self._rdt_rank_label
        )
        from sglang.srt.managers.weight_memory_listeners import (
            add_weight_memory_listener,
        )

        add_weight_memory_listener(self.scheduler, self._rdt_receiver)
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
        ``WeightsInconsistentError`` when a transfer broke mid-way.
        """
        receiver = self._receiver()

        def run(scheduler):
            why = _is_quiesced(scheduler)
            if why is not None:
                raise WeightSyncError(NOT_QUIESCED.format(why=why))
            self._rdt_update_touched = True
            return receiver.pull(weights_refs, param_names, timeout)

        budget = (timeout or receiver.pull_timeout_s) + SAFE_POINT_TIMEOUT_S
        try:
            stats = self._on_scheduler(run, budget)
        except BaseException as e:
            kind = failure_kind(e)
            self._rdt_updates.fail(kind)
            rdt_metrics.record_failure(kind)
            raise
        self._rdt_updates.on_pull(stats)
        rdt_metrics.record_pull(stats)
        return stats

    def begin_weight_update(self) -> Dict[str, Any]:
        """Open sglang's weight-update session on this rank (engine session use)."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._receiver()

        def run(scheduler):
            out = scheduler.weight_updater.begin_weight_update(BeginWeightUpdateReqInput())
            if not out.success:
                raise WeightSyncError(f"begin_weight_update failed: {out.message}")
            self._rdt_update_touched = False
            self._rdt_updates.start()
            return {"success": True}

        return self._on_scheduler(run)

    def finalize_weight_update(
        self, weight_version: Optional[str] = None, flush_cache: bool = True
    ) -> Dict[str, Any]:
        """Make the landed buckets servable: post-load processing, flush, version.

        Runs the model's ``post_load_weights`` through sglang's weight-update
        lifecycle (closing the session ``begin_weight_update`` opened, or on its
        own when the caller paused generation), flushes the prefix cache (its KV
        was computed with the old weights) and records ``weight_version``.
        Call it once per update, after every rank's pulls returned.
        """
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        receiver = self._receiver()

        def run(scheduler):
            updater = scheduler.weight_updater
            if updater._session is not None:
                out = updater.end_weight_update(EndWeightUpdateReqInput())
                if not out.success:
                    raise WeightSyncError(f"end_weight_update failed: {out.message}")
            else:
                why = _is_quiesced(scheduler)
                if why is not None:
                    raise WeightSyncError(
                        "refusing to finalize while generation may run: " + why
                    )
                for _, runner in updater._select_runners("all"):
                    runner.weight_updater.end_weight_update(run_post_load=True)
            flushed = scheduler.flush_cache() if flush_cache else False
            if weight_version is not None:
                scheduler.record_weight_version_change(new_version=str(weight_version))
            receiver.mark_consistent()
            receiver.end_of_update()
            self._rdt_update_touched = False
            return {
                "success": True,
                "flushed_cache": bool(flushed),
                "weight_version": self._weight_version(),
            }

        try:
            result = self._on_scheduler(run)
        except BaseException:
            self._rdt_updates.fail("finalize")
            rdt_metrics.record_failure("finalize")
            raise
        summary = self._rdt_updates.finish(
            result["weight_version"], flushed_cache=result["flushed_cache"]
        )
        rdt_metrics.record_update(summary["update_seconds"])
        logger.info(rdt_metrics.format_update(summary, self._rank_text()))
        result["update"] = summary
        return result

    def _rank_text(self) -> str:
        r = self._rdt_rank_label
        return f"dp{r['dp_rank']}/pp{r['pp_rank']}/tp{r['tp_rank']}"

    def abort_weight_update(self, reason: str = "update aborted") -> Dict[str, Any]:
        """Close an open session without a version bump.

        If any pull ran in it, this rank reports its weights as inconsistent
        until a later update is finalized.
        """
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        receiver = self._receiver()

        def run(scheduler):
            updater = scheduler.weight_updater
            if updater._session is not None:
                updater.end_weight_update(EndWeightUpdateReqInput())
            if self._rdt_update_touched:
                receiver.mark_inconsistent(reason)
            receiver.end_of_update()
            self._rdt_update_touched = False
            return receiver.status()

        self._rdt_updates.fail("abort")
        rdt_metrics.record_failure("abort")
        return self._on_scheduler(run)

    def get_weight_sync_status(self) -> Dict[str, Any]:
        """Consistency, registration and transfer counters of this rank."""
        status = {"enabled": self._rdt_enabled, "weight_version": self._weight_version()}
        if self._rdt_receiver is not None:
            status.update(self._rdt_receiver.status())
            status["last_update"] = self._rdt_updates.last
            status["transports"] = list(self._rdt_transports)
            from sglang.srt.ray.rdt import nixl_progress

            status["nixl_progress_thread"] = nixl_progress.describe()
        status["event_loop"] = self._rdt_safe_point.state
        status["idle_sleep"] = self._rdt_idle_sleep
        return status

    def get_weight_sync_stats(self) -> Dict[str, Any]:
        """Per-update figures of this rank: ``last_update`` (tensors, bytes,
        seconds, GB/s, transport, weight_version — the same as its log line),
        ``updates``, ``failures`` by kind, the pull counters and whether
        Prometheus metrics are on."""
        receiver = self._receiver()
        out = self._rdt_updates.snapshot()
        out.update(
            rank=self._rdt_rank_label,
            weight_version=self._weight_version(),
            pulls={k: v for k, v in receiver.stats.items() if k != "last_pull"},
            last_pull=receiver.stats.get("last_pull"),
            metrics_enabled=rdt_metrics.enabled(),
        )
        return out

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
