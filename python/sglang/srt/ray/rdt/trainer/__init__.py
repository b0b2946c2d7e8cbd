"""The trainer side of RDT weight sync: what runs in the trainer's processes.

- :mod:`.client` — :class:`WeightSyncClient`: discovery, validation, the
  update session and the bucket pipeline in one call;
- :mod:`.update_run` — one ``update()`` start to end (check, path, session,
  abort on failure);
- :mod:`.discovery`, :mod:`.sessions`, :mod:`.pipeline`, :mod:`.sender_link`,
  :mod:`.payloads`, :mod:`.stats` — its parts;
- :mod:`.buckets` — pure planning of buckets and steps;
- :mod:`.sender` — :class:`BucketSender`, the bucket buffers kept across
  updates (a Ray actor or in-process);
- :mod:`.hf_reshard` — Hugging Face state dicts turned into each rank's
  tensors with sglang's own loaders (``update(..., layout="hf")``);
- :mod:`.direct` — zero-copy updates: ranks on the trainer's node read the
  trainer's own tensors (no buckets);
- :mod:`.lane` — the trainer's side of the ranks' same-node call lanes
  (pulls of refs a rank read before, without a Ray round trip).

May import: torch, Ray, :mod:`sglang.srt.ray.rdt.errors`,
:mod:`sglang.srt.ray.rdt.ranks`, :mod:`sglang.srt.ray.rdt.defaults`,
:mod:`sglang.srt.ray.rdt.gc_pause`,
:mod:`..transport` and :mod:`sglang.srt.ray.actor_naming`. Never imports
:mod:`..engine`. Only :mod:`.hf_reshard` builds sglang models (model replicas
on the meta/CPU device, loaded lazily when an HF-format update asks for them).
"""
