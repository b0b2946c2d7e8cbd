"""What the rank core needs of a scheduler; every reach into sglang's Scheduler is in :class:`SglangSchedulerPort`."""

from __future__ import annotations

from typing import Iterator, Optional, Protocol, Tuple

import torch

from sglang.srt.ray.rdt.errors import WeightSyncError


class SchedulerPort(Protocol):
    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]: ...

    def session_open(self) -> bool:
        """Whether a weight-update session (``begin_weight_update``) is open."""

    def paused(self) -> bool:
        """Whether generation is paused on this rank (any mode)."""

    def idle(self) -> bool:
        """Whether no batch is running (waiting requests do not count)."""

    def begin_session(self) -> None:
        """Open the rank's weight-update session (raises on failure)."""

    def end_session(self, abort: Optional[str] = None) -> Optional[str]:
        """Close it: post-load, listeners (``abort``: why it is dropped instead). Returns what went wrong."""

    def run_post_load(self) -> None:
        """The model's post-load processing (an update made without a session)."""

    def flush_cache(self) -> bool: ...

    def record_weight_version(self, version: str) -> None: ...

    def weight_version(self) -> Optional[str]: ...

    def lora_layout(self, config: dict) -> Tuple[dict, torch.dtype, torch.device]:
        """A LoRA adapter's PEFT tensors (``{key: shape}``), their dtype and device."""

    def lora_apply(self, stash) -> None:
        """Serve the adapter ``stash`` holds (``adapter_stash.AdapterStash``) from its ``committed`` tensors, in place."""


class SglangSchedulerPort:
    """:class:`SchedulerPort` over sglang's ``Scheduler`` (on its own thread)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def named_parameters(self):
        return self.scheduler.tp_worker.model_runner.model.named_parameters()

    def session_open(self) -> bool:
        from sglang.srt.managers.scheduler_safe_point import weight_update_session_open

        return weight_update_session_open(self.scheduler)

    def paused(self) -> bool:
        return bool(getattr(self.scheduler, "_engine_paused", False))

    def idle(self) -> bool:
        return self.scheduler.is_fully_idle(ignore_waiting=True)

    def begin_session(self) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        out = self.scheduler.weight_updater.begin_weight_update(BeginWeightUpdateReqInput())
        if not out.success:
            raise WeightSyncError(f"begin_weight_update failed: {out.message}")

    def end_session(self, abort: Optional[str] = None) -> Optional[str]:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        req = EndWeightUpdateReqInput(abort=abort is not None, abort_reason=abort)
        out = self.scheduler.weight_updater.end_weight_update(req)
        return None if out.success else out.message

    def run_post_load(self) -> None:
        # what sglang's end_weight_update does on every runner when a session made the pulls
        for _, runner in self.scheduler.weight_updater._select_runners("all"):
            runner.weight_updater.end_weight_update(run_post_load=True)

    def flush_cache(self) -> bool:
        return bool(self.scheduler.flush_cache())

    def record_weight_version(self, version: str) -> None:
        self.scheduler.record_weight_version_change(new_version=str(version))

    def weight_version(self) -> Optional[str]:
        from sglang.srt.runtime_context import get_serving

        try:
            return get_serving().weight_version
        except Exception:
            return None

    def _lora_manager(self):
        manager = getattr(self.scheduler.tp_worker.model_runner, "lora_manager", None)
        if manager is None:
            raise WeightSyncError("LoRA is off on this engine: start it with --enable-lora (and "
                                  "--max-lora-rank, --lora-target-modules for adapters registered later)")
        return manager

    def lora_layout(self, config: dict):
        from sglang.srt.lora.adapter_stash import expected_tensors
        from sglang.srt.lora.lora_config import LoRAConfig

        manager = self._lora_manager()
        cfg = LoRAConfig.from_dict(config, base_vocab_size=manager.base_hf_config.vocab_size)
        if cfg.use_dora or cfg.hf_config.get("use_rslora") or not manager.memory_pool.can_support(cfg):
            raise WeightSyncError(f"LoRA config r={cfg.r}, target_modules={cfg.target_modules} does not fit this "
                                  f"engine: r must be <= --max-lora-rank ({manager.max_lora_rank}) and the targets "
                                  "within --lora-target-modules; DoRA and rsLoRA are not served")
        layout = expected_tensors(manager.lora_modules, cfg.target_modules, cfg.r)
        if not layout:
            raise WeightSyncError(f"no layer of this model is targeted by {cfg.target_modules}")
        return layout, manager.memory_pool.dtype, manager.device

    def lora_apply(self, stash) -> None:
        from sglang.srt.lora.lora_registry import LoRARef

        ref = LoRARef(lora_id=stash.lora_id, lora_name=stash.name, lora_path="__tensor__", pinned=False)
        out = self._lora_manager().upsert_lora_adapter_from_tensors(ref, stash.committed, stash.config,
                                                                  keep_device=True)
        if not out.success:
            raise WeightSyncError(f"LoRA adapter {stash.name}: {out.error_message}")
