"""Ray Direct Transport (RDT) weight sync for the Ray backend.

- :mod:`.engine` — what runs in a rollout rank: the rank core
  (``rank_sync.py``), its pull (``receiver.py``: plan, read, record), its
  sources (``sources.py``), its same-node lane (``local_lane.py``), the
  SchedulerActor's methods (``actor_mixin.py``) and the engine's session;
- :mod:`.trainer` — what runs in a trainer: :class:`WeightSyncClient`
  (``client.py``), one update (``update.py``), its planning (``buckets.py``),
  bucket slots (``sender.py``), the staging pool (``staging.py``) and lanes;
- :mod:`.transport` — how bytes move: same-node reads (CUDA IPC, one copy
  kernel; ``process_vm_readv``), the ``SGLANG_IPC`` Ray transport, and every
  Ray-private name used (``compat.py``).

``WeightSyncClient`` and ``WeightSyncRankError`` are imported on first use
(they pull in Ray).
"""

from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError

__all__ = [
    "WeightSyncClient",
    "WeightSyncError",
    "WeightSyncRankError",
    "WeightsInconsistentError",
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
