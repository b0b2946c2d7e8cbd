"""Ray Direct Transport (RDT) weight sync for the Ray backend.

- :mod:`.plan` — pure checks: which live tensor each pulled tensor lands in;
- :mod:`.receiver` — the rank side: NIXL (or the same-node fast path) writes
  into live parameters;
- :mod:`.actor_mixin` — the SchedulerActor methods (``pull_weights``, ...);
- :mod:`.client` — the trainer side: :class:`WeightSyncClient`;
- :mod:`.metrics` — Prometheus metrics and the per-update summary.

``WeightSyncClient`` and ``WeightSyncRankError`` are imported on first use
(they pull in Ray).
"""

from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError

__all__ = [
    "WeightSyncClient",
    "WeightSyncError",
    "WeightSyncRankError",
    "WeightsInconsistentError",
]

_LAZY = {"WeightSyncClient", "WeightSyncRankError"}


def __getattr__(name):
    if name in _LAZY:
        from sglang.srt.ray.rdt.trainer import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
