"""Ray Direct Transport (RDT) weight sync for the Ray backend.

- :mod:`.engine`: what runs in a rollout rank (its pull, lane, actor methods,
  the engine's session);
- :mod:`.trainer`: what runs in a trainer (:class:`WeightSyncClient`);
- :mod:`.transport`: how bytes move (CUDA IPC, ``process_vm_readv``, the
  ``SGLANG_IPC`` Ray transport) and every Ray-private name used.

``WeightSyncClient`` and ``WeightSyncRankError`` are imported on first use
(they pull in Ray).
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
