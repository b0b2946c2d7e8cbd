"""``RayEngine``'s weight-update session, the one of ``/weight_sync/*``::

    engine = RayEngine(model_path=..., enable_rdt_weight_sync=True)
    engine.begin_weight_sync()            # drains in-flight requests, holds new ones
    ray.get([a.pull_weights.remote([ref], names) for a in engine.get_scheduler_actors()])
    engine.end_weight_sync(weight_version="7")   # post-load, flush, version; resumes
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from sglang.srt.ray.rdt.defaults import SESSION_DRAIN_TIMEOUT_S, SESSION_LEASE_S
from sglang.srt.ray.rdt.engine.session import WeightSyncSession


class RdtEngineMixin:
    def get_scheduler_actors(self) -> List[Any]:
        """Handles of this engine's SchedulerActors (rank order)."""
        return list(self._scheduler_init_result.scheduler_actors)

    def _weight_sync_session(self) -> WeightSyncSession:
        if getattr(self, "_rdt_session", None) is None:
            self._rdt_session = WeightSyncSession(self.tokenizer_manager, self.get_scheduler_actors)
        return self._rdt_session

    def begin_weight_sync(self, lease_s: float = SESSION_LEASE_S,
                          drain_timeout_s: float = SESSION_DRAIN_TIMEOUT_S) -> Dict[str, Any]:
        return self.loop.run_until_complete(self._weight_sync_session().begin(lease_s, drain_timeout_s))

    def end_weight_sync(self, weight_version: Optional[str] = None, flush_cache: bool = True) -> Dict[str, Any]:
        return self.loop.run_until_complete(self._weight_sync_session().end(weight_version, flush_cache))

    def abort_weight_sync(self, reason: str = "update aborted by the trainer") -> Dict[str, Any]:
        return self.loop.run_until_complete(self._weight_sync_session().abort(reason))
