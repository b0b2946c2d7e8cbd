"""The engine side of RDT weight sync: what runs inside a rollout rank.

- :mod:`.rank_sync` — :class:`RankWeightSync`, the rank core (pull, begin,
  finalize, abort, status), reaching the scheduler only through
  :mod:`.scheduler_port`;
- :mod:`.receiver` — a pull: plan (:mod:`.plan`), read (:mod:`.sources`),
  record; NIXL registration of the parameters (:mod:`.registration`);
- :mod:`.update_state` — :class:`RankUpdateState`, the one owner of a rank's
  update state (open or not, writers per parameter, consistency, counters);
- :mod:`.local_lane` — :class:`RankLane`, same-node requests without Ray;
- :mod:`.actor_mixin` — the rank actor API and the SchedulerActor that has it;
  :mod:`.standalone` — the same API around a plain model;
- :mod:`.session`, :mod:`.http_routes`, :mod:`.engine_mixin` — the
  engine-wide update session (``/weight_sync/*``, ``RayEngine``);
- :mod:`.metrics` — Prometheus metrics of a rank.

May import: :mod:`sglang.srt.ray.rdt.errors`, :mod:`sglang.srt.ray.rdt.defaults`,
:mod:`sglang.srt.ray.rdt.gc_pause`, :mod:`..transport`, sglang's
scheduler-side modules (lazily, inside the functions that need them). Never
imports :mod:`..trainer`.
"""
