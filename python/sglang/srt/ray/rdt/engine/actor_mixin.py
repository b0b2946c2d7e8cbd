"""The weight-sync methods of a rank actor (:class:`RankActorApi`), and their SchedulerActor wiring.

The API runs over the rank core in ``self._rdt_sync`` (``sglang/test/rdt_standalone.py`` has it around a plain
model). Pulls, begin, finalize and abort run on the scheduler's thread between loop iterations; a pull is refused
unless generation is paused and no batch is running. On a TP/PP group, begin/finalize/abort and
``register_lora_adapter`` are called on the group's first rank and act on every rank in the same loop iteration.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Dict, Optional, Sequence

import torch

from sglang.srt.ray.rdt.defaults import NIXL, PULL_TIMEOUT_S
from sglang.srt.ray.rdt.engine import metrics as rdt_metrics
from sglang.srt.ray.rdt.engine.rank_sync import RankWeightSync
from sglang.srt.ray.rdt.errors import WeightSyncError

logger = logging.getLogger(__name__)

MEMORY_SAVER_REASON = ("--enable-memory-saver: parameter storage is released and re-mapped, so it cannot stay "
                       "registered; pulls register per call instead")


class RankActorApi:
    """The public weight-sync methods of a rank actor (``self._rdt_sync``)."""

    _rdt_sync: Optional[RankWeightSync] = None

    def _sync(self) -> RankWeightSync:
        if self._rdt_sync is None:
            raise WeightSyncError("RDT weight sync is off on this engine: start it with "
                                  "--enable-rdt-weight-sync (and --backend ray)")
        return self._rdt_sync

    def register_weight_for_rdt(self) -> Dict[str, Any]:
        """Register every parameter's storage with NIXL once (idempotent), so pulls skip registration.
        Returns ``{"registered": bool, ...}``; under ``--enable-memory-saver`` nothing is, and ``reason`` says why."""
        return self._sync().receiver.register()

    def pull_weights(self, weights_refs: Sequence[Any], param_names, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Fetch RDT refs straight into this rank's live parameters.

        Args:
            weights_refs: refs from ``ray.put(tensors, _tensor_transport="nixl")`` (or ``"SGLANG_IPC"``), passed
                nested (``pull_weights.remote([ref], names)``) so Ray hands over the refs, not their values.
            param_names: this rank's ``named_parameters()`` name of every tensor: one flat list in the refs'
                order (miles' shape) or one list per ref. Tensors must be in its layout (dtype, TP shard shape).
            timeout: seconds for the transfer (default ``rdt_pull_timeout``).

        Returns: ``{"tensors", "bytes", "seconds", "gbps", "transport", ...}``.

        Raises: ``WeightSyncError`` before any byte moves for a bad call (names, shapes, dtypes, refs) or while
        generation may run; ``WeightUpdateConflictError`` before any byte moves when another writer wrote one
        of the parameters in this update; ``WeightsInconsistentError`` when a transfer broke mid-way.
        """
        return self._sync().pull(weights_refs, param_names, timeout)

    def begin_weight_update(self) -> Dict[str, Any]:
        """Open sglang's weight-update session on this rank's group (``POST /begin_weight_update``)."""
        return self._sync().begin()

    def finalize_weight_update(self, weight_version: Optional[str] = None, flush_cache: bool = True) -> Dict[str, Any]:
        """End the update: ``/update_weight_version`` + ``/end_weight_update`` + a prefix-cache flush (without
        an open session, the model's post-load runs here). Call it once, after every rank's pulls returned.
        Raises ``WeightSyncError`` when the update was not clean (a broken transfer, two writers of a parameter)."""
        return self._sync().finalize(weight_version, flush_cache)

    def abort_weight_update(self, reason: str = "update aborted") -> Dict[str, Any]:
        """Close the update without a version bump; if a pull touched the weights, they are reported
        inconsistent until a clean update ends."""
        return self._sync().abort(reason)

    def register_lora_adapter(self, lora_name: str, config_dict: Dict[str, Any],
                              lora_id: Optional[str] = None) -> Dict[str, Any]:
        """Register LoRA adapter ``lora_name`` (``config_dict``: its PEFT adapter_config) for weight sync on this
        rank's TP/PP group: created zeroed, or kept (slot, weights) if the config is the same. Its tensors travel
        in an update as ``"{lora_name}:{PEFT key}"``, unsharded; returns them (``expected_tensors``: name -> shape,
        ``dtype``). ``POST /register_lora_adapter`` calls this on every group and serves the adapter by name."""
        return self._sync().register_lora(lora_name, config_dict, lora_id or uuid.uuid4().hex)

    def get_weight_sync_status(self) -> Dict[str, Any]:
        """Consistency, the update in progress, registration, counters, reach."""
        if self._rdt_sync is None:
            return {"enabled": False}
        return self._rdt_sync.status().as_dict()

    def get_weight_sync_stats(self) -> Dict[str, Any]:
        """This rank's figures: ``last_update`` (its log line's), ``updates``, ``failures`` by kind, pull counters."""
        return {**self._sync().stats(), "metrics_enabled": rdt_metrics.enabled()}

    def get_parameter_checksums(self) -> Dict[str, str]:
        """sha256 of every live parameter's bytes, read on the scheduler thread."""
        return self._sync().parameter_checksums()

    def get_parameter_layout(self) -> Dict[str, Dict[str, Any]]:
        """``{name: {"shape", "dtype", "data_ptr"}}`` of the live parameters: what a pull expects."""
        return self._sync().parameter_layout()

    def release_weight_sync_mappings(self, sender_token: Optional[str] = None) -> int:
        """Close the kept CUDA IPC mappings of trainer process ``sender_token``'s memory (``None``: every
        sender) before the trainer frees it. Returns how many closed."""
        return self._sync().release_sender(sender_token)

    def open_weight_sync_lane(self, sender_token: str, pid: int = 0, probe=None) -> Dict[str, Any]:
        """Open the same-node call lane (:mod:`.local_lane`) for trainer process ``sender_token`` (its
        ``same_node.token()``; ``pid``: its process id). Returns ``{"address", "secret", "pid", "node_id", ...}``,
        or ``{"node_id", "unreadable"}`` when this rank cannot read ``probe`` (bytes 0..255 the trainer described)."""
        return self._sync().open_lane(sender_token, pid, probe)

    def shutdown_weight_sync(self) -> int:
        """Release NIXL registrations and mappings; later pulls are refused."""
        return 0 if self._rdt_sync is None else self._rdt_sync.shutdown()


class RdtWeightSyncMixin(RankActorApi):
    """SchedulerActor wiring: safe-point queue, weight listeners, metrics, same-node transport, orphan watch."""

    def _init_weight_sync(self, server_args) -> None:
        from sglang.srt.managers.scheduler_safe_point import (SafePointQueue, attach_safe_point_queue,
                                                              wake_idle_sleeper_on_tasks)
        from sglang.srt.managers.weight_listeners import add_weight_listener
        from sglang.srt.ray.lifecycle import watch_owner_job
        from sglang.srt.ray.rdt.engine.scheduler_port import SglangSchedulerPort
        from sglang.srt.ray.rdt.transport import sglang_ipc
        from sglang.srt.runtime_context import get_device

        device = get_device()
        self._rdt_gpu_id, self._rdt_device = device.gpu_id, device.device
        safe_point = SafePointQueue()
        attach_safe_point_queue(self.scheduler, safe_point)  # run by the scheduler's loop
        idle_sleep = "off"
        if getattr(self.scheduler, "idle_sleeper", None) is not None:
            # --sleep-on-idle: a queued call wakes the loop at once, not after its poll timeout (up to 1 s).
            woken = wake_idle_sleeper_on_tasks(self.scheduler, safe_point)
            idle_sleep = "wakes on weight-sync calls" if woken else "weight-sync calls wait for its timeout"
        watch_owner_job(self._exit_orphaned)
        labels = self._rank_labels()
        self._rdt_sync = RankWeightSync(
            SglangSchedulerPort(self.scheduler), safe_point,
            rank=f"dp{labels['dp_rank']}/pp{labels['pp_rank']}/tp{labels['tp_rank']}",
            device=torch.device("cuda", device.gpu_id) if device.device == "cuda" else None,
            pull_timeout_s=float(getattr(server_args, "rdt_pull_timeout", PULL_TIMEOUT_S)), transports=[NIXL],
            registration_disabled_reason=(
                MEMORY_SAVER_REASON if getattr(server_args, "enable_memory_saver", False) else None))
        self._rdt_sync.idle_sleep = idle_sleep
        self._rdt_sync.group = self._group_calls(safe_point)
        self._rdt_rank_label = labels
        rdt_metrics.configure(bool(getattr(server_args, "enable_metrics", False)), labels)
        add_weight_listener(self.scheduler, self._rdt_sync)
        # Ray pushes custom transports to new actors asynchronously: register the same-node one here.
        try:
            self._rdt_sync.transports.append(sglang_ipc.register())
        except Exception as e:
            logger.warning("[RDT] same-node fast path unavailable, NIXL only: %s", e)

    def _group_calls(self, safe_point):
        """Group calls over this rank's TP/PP group (None: a group of one)."""
        from sglang.srt.managers.scheduler_group_calls import GroupCalls, attach_group_calls, gather_over
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        if par.tp_size * par.pp_size == 1:
            return None
        calls = GroupCalls(self._rdt_sync.group_op, entry=par.tp_rank == 0 and par.pp_rank == 0,
                           gather=gather_over(par.tp_group.cpu_group) if par.tp_size > 1 else None,
                           loop_state=lambda: safe_point.state, label=self._rdt_sync.state.rank)
        attach_group_calls(self.scheduler, calls)
        return calls

    def _rank_labels(self) -> Dict[str, str]:
        cfg = self.get_parallelism_config()
        return {k: str(cfg.get(k) or 0) for k in ("dp_rank", "pp_rank", "tp_rank")}

    def _exit_orphaned(self, why: str) -> None:
        import ray

        logger.error("[RDT] %s; this detached scheduler actor exits", why)
        try:
            self.shutdown_weight_sync()
        finally:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def get_weight_sync_stats(self) -> Dict[str, Any]:
        return {**super().get_weight_sync_stats(), "rank": self._rdt_rank_label}

    def get_parallelism_config(self) -> Dict[str, Any]:
        """This rank's parallel layout (the same record the bootstrap server serves)."""
        from sglang.srt.model_executor.parallelism_config import read_parallelism_config

        return read_parallelism_config(self._rdt_gpu_id, self._rdt_device)

    def get_ray_placement(self) -> Dict[str, Any]:
        """Where Ray put this actor: placement group, node, namespace, job."""
        import ray

        ctx = ray.get_runtime_context()
        return {"placement_group_id": ctx.get_placement_group_id(), "node_id": ctx.get_node_id(),
                "namespace": ctx.namespace, "job_id": ctx.get_job_id(), "actor_name": ctx.get_actor_name()}
