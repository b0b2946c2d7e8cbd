"""The engine side of RDT weight sync: what runs inside a rollout rank.

- :mod:`.rank_sync`: :class:`RankWeightSync`, the rank core, reaching the
  scheduler only through :mod:`.scheduler_port`;
- :mod:`.receiver`: a pull (plan :mod:`.plan`, read :mod:`.sources`, record)
  and NIXL registration (:mod:`.registration`);
- :mod:`.update_state`: the one owner of a rank's update state;
- :mod:`.local_lane`: same-node requests without Ray;
- :mod:`.actor_mixin`: the rank actor API (``sglang.test.rdt_standalone``:
  the same API around a plain model, for tests and benchmarks);
- :mod:`.session`, :mod:`.http_routes`, :mod:`.engine_mixin`: the engine-wide
  update session; :mod:`.metrics`: a rank's Prometheus metrics.

May import :mod:`sglang.srt.ray.rdt.errors`, ``.defaults``, ``.gc_pause``,
:mod:`..transport` and sglang's scheduler-side modules (lazily, inside the
functions that need them). Never imports :mod:`..trainer`.
"""
