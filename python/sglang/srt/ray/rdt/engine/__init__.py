"""The engine side of RDT weight sync: what runs inside a rollout rank.

- :mod:`.rank_sync` — :class:`RankWeightSync`, the rank core (pull, begin,
  finalize, abort, status), reaching the scheduler only through
  :mod:`.scheduler_port`;
- :mod:`.update_state` — :class:`RankUpdateState`, the one owner of a rank's
  update state (open/closed, writers per parameter, consistency, counters,
  the per-update log line);
- :mod:`.receiver` — pulls RDT refs into live parameters, with
  :mod:`.plan` (which live tensor each pulled tensor lands in, checked before
  any byte moves), :mod:`.refs` (Ray's record of a ref),
  :mod:`.registration` (NIXL registration of the parameters) and
  :mod:`.nixl_traps` (the two silent NIXL slow paths, named);
- :mod:`.actor_mixin` — the SchedulerActor's weight-sync methods, wiring the
  core to the actor; :mod:`.standalone` — the core around a plain model;
- :mod:`.local_lane` — :class:`RankLane`, the rank's same-node call lane
  (a Unix socket into the core's own pull, for refs the rank read before);
- :mod:`.session`, :mod:`.http_routes`, :mod:`.engine_mixin` — the
  engine-wide update session (``/weight_sync/*``, ``RayEngine``);
- :mod:`.metrics` — Prometheus metrics of a rank.

May import: :mod:`sglang.srt.ray.rdt.errors`, :mod:`sglang.srt.ray.rdt.defaults`,
:mod:`sglang.srt.ray.rdt.gc_pause`, :mod:`..transport`, sglang's
scheduler-side modules (lazily, inside the functions that need them). Never
imports :mod:`..trainer`.
"""
