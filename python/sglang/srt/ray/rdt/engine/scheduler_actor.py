"""sglang's SchedulerActor plus :class:`~.actor_mixin.RdtWeightSyncMixin`, for ``--enable-rdt-weight-sync``;
declared with ``enable_tensor_transport=True`` so RDT refs can be passed to it."""

from __future__ import annotations

import ray

from sglang.srt.ray.rdt.engine.actor_mixin import RdtWeightSyncMixin
from sglang.srt.ray.scheduler_actor import SchedulerActorBase


class SchedulerActor(RdtWeightSyncMixin, SchedulerActorBase):
    __doc__ = SchedulerActorBase.__doc__

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        self._init_weight_sync(server_args)

    def run_event_loop(self) -> None:
        tasks = self._rdt_sync.safe_point
        tasks.loop_started()
        try:
            super().run_event_loop()
        finally:
            tasks.loop_stopped()
            self.shutdown_weight_sync()


RdtSchedulerActor = ray.remote(enable_tensor_transport=True)(SchedulerActor)
