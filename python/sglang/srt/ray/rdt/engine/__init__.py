"""The engine side of RDT weight sync: what runs inside a rollout rank (docs/architecture.md maps its modules).

May import :mod:`sglang.srt.ray.rdt.errors`, ``.defaults``, :mod:`..transport` and sglang's
scheduler-side modules (lazily, inside the functions that need them). Never imports :mod:`..trainer`.
"""
