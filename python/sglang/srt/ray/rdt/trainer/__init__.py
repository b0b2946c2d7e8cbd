"""The trainer side of RDT weight sync: what runs in the trainer's processes.

- :mod:`.client` — :class:`WeightSyncClient`: ``register()``, ``update()``;
  :mod:`.route` — how an update reaches each rank (lanes, in place or slots);
- :mod:`.update` — one update: plan, transfer, finish;
- :mod:`.buckets` — pure planning: rank groups, groups, layout checks, slots;
- :mod:`.sender` — the two bucket slots; :mod:`.staging` — GPU memory the
  ranks keep mapped; :mod:`.lane` — the trainer's side of the call lanes;
- :mod:`.sessions`, :mod:`.discovery`, :mod:`.stats` — the engine's update
  session, finding the ranks, what an update returns;
- :mod:`.hf_reshard` — Hugging Face state dicts resharded per rank with
  sglang's own loaders (``update(..., layout="hf")``).

May import: torch, numpy, Ray, :mod:`..transport`, :mod:`sglang.srt.ray.rdt.errors`,
:mod:`sglang.srt.ray.rdt.ranks`, :mod:`sglang.srt.ray.rdt.defaults` and
:mod:`sglang.srt.ray.actor_naming`. Never imports :mod:`..engine`; only
:mod:`.hf_reshard` builds sglang models.
"""
