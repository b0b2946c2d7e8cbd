"""Ray Direct Transport (RDT) weight sync for the Ray backend: :mod:`.engine` runs in a rollout rank,
:mod:`.trainer` in a trainer, :mod:`.transport` moves bytes. Names that pull in Ray (``_LAZY``) load on first use.
"""

from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError, WeightUpdateConflictError

__all__ = [
    "WeightSyncClient",
    "WeightSyncError",
    "WeightSyncRankError",
    "WeightsInconsistentError",
    "WeightUpdateConflictError",
    "start_nixl_agent",
]

_LAZY = {"WeightSyncClient": "sglang.srt.ray.rdt.trainer.client",
         "WeightSyncRankError": "sglang.srt.ray.rdt.trainer.client",
         "start_nixl_agent": "sglang.srt.ray.rdt.transport.nixl_threads"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
