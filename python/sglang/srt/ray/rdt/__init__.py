"""Ray Direct Transport (RDT) weight sync for the Ray backend.

- :mod:`.plan` — pure checks: which live tensor each pulled tensor lands in;
- :mod:`.receiver` — the rank side: NIXL writes into live parameters;
- :mod:`.actor_mixin` — the SchedulerActor methods (``pull_weights``, ...).
"""

from sglang.srt.ray.rdt.plan import WeightsInconsistentError, WeightSyncError

__all__ = ["WeightSyncError", "WeightsInconsistentError"]
