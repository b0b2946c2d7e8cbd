"""The weight-sync methods of a SchedulerActor.

``SchedulerActor`` inherits :class:`RdtWeightSyncMixin`; with
``--enable-rdt-weight-sync`` a trainer (usually in another Ray job) calls:

``register_weight_for_rdt()``
    Pin the model's parameters with NIXL once, so pulls skip registration.
``pull_weights(weights_refs, param_names, timeout=None, finalize=None)``
    Write the tensors behind RDT refs straight into live parameters.
``prepare_pull_weights(weights_refs, param_names)``
    All of a pull but the bytes (checks, plan, same-node mappings), once at connect.
``open_weight_sync_lane(sender_token)``
    A same-node call lane: later pulls of refs read once, without Ray's round trip.

The update around the pulls is sglang's own lifecycle, over HTTP (what miles
does: ``/pause_generation``, ``/begin_weight_update``, pulls,
``/update_weight_version``, ``/end_weight_update``, ``/continue_generation``)
or as actor calls: ``begin_weight_update()``,
``finalize_weight_update(weight_version=None, flush_cache=True)`` (version,
``end_weight_update``, flush) and ``abort_weight_update(reason)``. Whichever
path drives it, the scheduler tells this rank's
:class:`~sglang.srt.ray.rdt.engine.update_state.RankUpdateState` (the one owner of
the update's state) through its weight listeners. The work itself is the
rank core's (:class:`~.rank_sync.RankWeightSync`); this mixin wires it to the
actor: the scheduler's safe-point queue, its weight listeners, metrics, the
same-node transport, and the orphan watch of detached actors. For anyone:
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
from typing import Any, Dict, Optional, Sequence

import torch

from sglang.srt.managers.scheduler_safe_point import SafePointQueue, wake_idle_sleeper_on_tasks
from sglang.srt.ray.rdt.defaults import NIXL, PULL_TIMEOUT_S, SAFE_POINT_TIMEOUT_S
from sglang.srt.ray.rdt.engine import metrics as rdt_metrics
from sglang.srt.ray.rdt.engine.rank_sync import (
    RankWeightSync,
    parameter_checksums,
    parameter_layout,
)
from sglang.srt.ray.rdt.engine.scheduler_port import SglangSchedulerPort
from sglang.srt.ray.rdt.errors import WeightSyncError

logger = logging.getLogger(__name__)

MEMORY_SAVER_REASON = (
    "--enable-memory-saver: parameter storage is released and re-mapped, "
    "so it cannot stay registered; pulls register per call instead"
)


class RdtWeightSyncMixin:
    """Mixed into SchedulerActor; all state lives under ``_rdt_*`` names."""

    def _init_weight_sync(self, server_args, gpu_id: int) -> None:
        from sglang.srt.runtime_context import get_device

        self._rdt_enabled = bool(getattr(server_args, "enable_rdt_weight_sync", False))
        self._rdt_sync: Optional[RankWeightSync] = None
        self._rdt_gpu_id = gpu_id
        self._rdt_device = get_device().device
        self._rdt_port = SglangSchedulerPort(self.scheduler)
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
        self._rdt_rank_label = self._rank_labels()
        r = self._rdt_rank_label
        self._rdt_sync = RankWeightSync(
            self._rdt_port,
            self._rdt_safe_point,
            rank=f"dp{r['dp_rank']}/pp{r['pp_rank']}/tp{r['tp_rank']}",
            device=torch.device("cuda", gpu_id) if self._rdt_device == "cuda" else None,
            pull_timeout_s=float(getattr(server_args, "rdt_pull_timeout", PULL_TIMEOUT_S)),
            registration_disabled_reason=(
                MEMORY_SAVER_REASON if getattr(server_args, "enable_memory_saver", False) else None
            ),
            transports=[NIXL],
        )
        rdt_metrics.configure(bool(getattr(server_args, "enable_metrics", False)), r)
        from sglang.srt.managers.weight_listeners import add_weight_listener

        add_weight_listener(self.scheduler, self._rdt_sync)
        # The same-node fast path (CUDA IPC for GPUs, process_vm_readv for
        # CPU memory); Ray pushes custom transports to new actors
        # asynchronously, so register it here ourselves.
        try:
            from sglang.srt.ray.rdt.transport import sglang_ipc

            self._rdt_sync.transports.append(sglang_ipc.register())
        except Exception as e:
            logger.warning("[RDT] same-node fast path unavailable, NIXL only: %s", e)

    def _rank_labels(self) -> Dict[str, str]:
        try:
            cfg = self.get_parallelism_config()
        except Exception:  # pragma: no cover - the runtime context is published first
            cfg = {}
        return {k: str(cfg.get(k) or 0) for k in ("dp_rank", "pp_rank", "tp_rank")}

    def _exit_orphaned(self, why: str) -> None:
        import ray

        logger.error("[RDT] %s; this detached scheduler actor exits", why)
        try:
            self.shutdown_weight_sync()
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _sync(self) -> RankWeightSync:
        if self._rdt_sync is None:
            raise WeightSyncError(
                "RDT weight sync is off on this engine: start it with "
                "--enable-rdt-weight-sync (and --backend ray)"
            )
        return self._rdt_sync

    # ------------------------------------------------------------------ #
    # Public actor API
    # ------------------------------------------------------------------ #
    def register_weight_for_rdt(self) -> Dict[str, Any]:
        """Register every parameter's storage with NIXL once (idempotent).

        Later pulls then skip memory registration. Returns
        ``{"registered": bool, ...}``; with ``--enable-memory-saver`` nothing is
        registered and ``reason`` says why.
        """
        return self._sync().receiver.register()

    def pull_weights(
        self,
        weights_refs: Sequence[Any],
        param_names,
        timeout: Optional[float] = None,
        finalize: Optional[Dict[str, Any]] = None,
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
            finalize: this is the rank's last pull of the update: after it
                landed, end the update as :meth:`finalize_weight_update` does
                (``{"weight_version": ..., "flush_cache": ...}``, both
                optional) in the same call — one round trip less for a
                trainer that sends a rank all its tensors at once.

        Returns: ``{"tensors", "bytes", "seconds", "gbps", ...}`` (plus
        ``"finalized"``, the finalize's result, with ``finalize``).

        Raises ``WeightSyncError`` before any byte moves for a bad call (names,
        shapes, dtypes, refs), or when generation may be running;
        ``WeightUpdateConflictError`` before any byte moves when another
        writer already wrote one of the parameters in this update;
        ``WeightsInconsistentError`` when a transfer broke mid-way.
        """
        return self._sync().pull(weights_refs, param_names, timeout, finalize)

    def prepare_pull_weights(self, weights_refs: Sequence[Any], param_names) -> Dict[str, Any]:
        """Everything of ``pull_weights(weights_refs, param_names)`` but the
        bytes: the same checks (a bad call raises the same ``WeightSyncError``),
        the plan kept, the sender's same-node memory mapped. Writes nothing
        and needs no pause. A trainer calls it once at connect with refs of
        the tensors it will send (``WeightSyncClient.register(tensors)``), so
        its first update costs what later ones do. Returns ``{"tensors",
        "refs", "same_node_refs", "plan_reused", "seconds"}``."""
        return self._sync().prepare(weights_refs, param_names)

    def begin_weight_update(self) -> Dict[str, Any]:
        """Open sglang's weight-update session on this rank (what
        ``POST /begin_weight_update`` does for every rank)."""
        return self._sync().begin()

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
        return self._sync().finalize(weight_version, flush_cache)

    def abort_weight_update(self, reason: str = "update aborted") -> Dict[str, Any]:
        """Close the update without a version bump.

        If any pull ran in it, this rank reports its weights as inconsistent
        until a later clean update ends.
        """
        return self._sync().abort(reason)

    def get_weight_sync_status(self) -> Dict[str, Any]:
        """Consistency, the update in progress, registration and counters."""
        status = {"enabled": self._rdt_enabled}
        if self._rdt_sync is not None:
            status.update(self._rdt_sync.status())
        status["weight_version"] = self._rdt_port.weight_version()
        status["event_loop"] = self._rdt_safe_point.state
        # pulls run on their caller's thread while the loop waited (lent safe point)
        status["lent_pulls"] = self._rdt_safe_point.lent
        status["idle_sleep"] = self._rdt_idle_sleep
        return status

    def get_weight_sync_stats(self) -> Dict[str, Any]:
        """Per-update figures of this rank: ``last_update`` (tensors, bytes,
        seconds, GB/s, transport, writers, parameters updated, weight_version
        — the same as its log line), ``updates``, ``failures`` by kind, the
        pull counters and whether Prometheus metrics are on."""
        return {
            **self._sync().stats(),
            "rank": self._rdt_rank_label,
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
        port = self._rdt_port
        return self._rdt_safe_point.call(
            self.scheduler, lambda _: parameter_checksums(port.named_parameters()),
            SAFE_POINT_TIMEOUT_S,
        )

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
        return parameter_layout(self._rdt_port.named_parameters())

    def release_weight_sync_mappings(self, sender_token: Optional[str] = None) -> int:
        """Close this rank's cached CUDA IPC mappings of one trainer process's
        memory (``sender_token``; every sender: ``None``). A trainer calls it
        before it frees buckets it declared persistent (``WeightSyncClient``
        does, on close and when its buckets grow). Returns how many closed."""
        return self._sync().release_sender(sender_token)

    def open_weight_sync_lane(self, sender_token: str) -> Dict[str, Any]:
        """A same-node call lane for the trainer process ``sender_token``
        (``sglang_ipc.sender_token()`` there): ``{"address", "secret", "pid",
        "node_id"}``. Over it that trainer sends ``pull_weights`` of refs
        this rank already read from it once through Ray, without a Ray round
        trip (:mod:`sglang.srt.ray.rdt.engine.local_lane`);
        ``WeightSyncClient`` does for zero-copy updates."""
        return self._sync().open_lane(sender_token)

    def shutdown_weight_sync(self) -> int:
        """Release NIXL registrations; later pulls are refused."""
        return 0 if self._rdt_sync is None else self._rdt_sync.shutdown()
