"""The trainer side of RDT weight sync: :mod:`.client` and what it drives (listed in docs/architecture.md).

May import: torch, numpy, Ray, :mod:`..transport`, :mod:`..errors`, :mod:`..ranks`, :mod:`..defaults` and
:mod:`sglang.srt.ray.actor_naming`. Never imports :mod:`..engine`; only :mod:`.hf_reshard` builds sglang models.
"""
