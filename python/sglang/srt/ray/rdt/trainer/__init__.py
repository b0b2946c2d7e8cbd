"""The trainer side of RDT weight sync: what runs in the trainer's processes.

- :mod:`.client` — :class:`WeightSyncClient`: discovery, the route of an
  update (lanes, in place or through slots), the session, ``update()``;
- :mod:`.update` — one update: plan, transfer, finish;
- :mod:`.buckets` — pure planning: rank groups, groups, layout checks, slots;
- :mod:`.sender` — :class:`BucketSender`: the two bucket slots (in this
  process or a Ray actor);
- :mod:`.staging` — the staging pool: GPU memory the ranks keep mapped;
- :mod:`.lane` — the trainer's side of the ranks' same-node call lanes;
- :mod:`.sessions`, :mod:`.discovery`, :mod:`.stats` — the engine's update
  session, finding the ranks, what an update returns;
- :mod:`.hf_reshard` — Hugging Face state dicts turned into each rank's
  tensors with sglang's own loaders (``update(..., layout="hf")``).

May import: torch, numpy, Ray, :mod:`..transport`, :mod:`sglang.srt.ray.rdt.errors`,
:mod:`sglang.srt.ray.rdt.ranks`, :mod:`sglang.srt.ray.rdt.defaults` and
:mod:`sglang.srt.ray.actor_naming`. Never imports :mod:`..engine`. Only
:mod:`.hf_reshard` builds sglang models (replicas on the meta/CPU device).
"""
