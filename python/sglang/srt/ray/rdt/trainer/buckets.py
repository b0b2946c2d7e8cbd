"""What a weight update sends, and in which bucket: pure planning for the trainer side.

Nothing here talks to Ray or NIXL. :class:`~sglang.srt.ray.rdt.trainer.client.WeightSyncClient`
uses these functions to

1. check every tensor the trainer gives against each rank's live parameters
   (:func:`check_tensors`: names, shapes, dtypes) — before any byte moves;
2. group ranks that take the same tensors (every rank with TP 1; with TP > 1,
   the DP replicas of one TP shard), so one bucket serves them all
   (:func:`group_ranks`);
3. cut each group's tensors into buckets that fit a fixed, reusable buffer
   (:func:`plan_buckets`) and lay one *step* of the update — bucket ``k`` of
   every group — out in one buffer (:func:`plan_steps`).

A slice's offset is aligned (:data:`ALIGN`) so that a byte buffer can be viewed
as any dtype at that offset.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

from sglang.srt.ray.rdt.errors import WeightSyncError

# Offsets inside a bucket are multiples of this (covers every dtype's alignment
# and a GPU cache line).
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` / ``"torch.float32"`` / ``"float32"`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorItem:
    """One tensor of an update, as planning sees it."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Slice:
    """Where one tensor lives inside a bucket (offset relative to the bucket)."""

    name: str
    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str


@dataclass
class Bucket:
    index: int
    slices: List[Slice] = field(default_factory=list)

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.slices]

    @property
    def nbytes(self) -> int:
        """Payload bytes (without alignment padding)."""
        return sum(s.nbytes for s in self.slices)

    @property
    def extent(self) -> int:
        """Bytes of buffer the bucket occupies (with padding)."""
        if not self.slices:
            return 0
        last = self.slices[-1]
        return align_up(last.offset + last.nbytes)


@dataclass(frozen=True)
class Region:
    """One group's bucket inside a step's buffer."""

    group: int
    offset: int  # of the bucket inside the buffer
    bucket: Bucket


@dataclass
class Step:
    """Bucket ``index`` of every group, laid out in one buffer."""

    index: int
    regions: List[Region]

    @property
    def nbytes(self) -> int:
        return sum(r.bucket.nbytes for r in self.regions)

    @property
    def tensors(self) -> int:
        return sum(len(r.bucket.slices) for r in self.regions)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def _close(name: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if close:
        return "did you mean " + ", ".join(repr(c) for c in close) + "?"
    return f"it has {len(candidates)} parameters, e.g. {next(iter(candidates), None)!r}"


def check_tensors(
    items: Sequence[TensorItem],
    layout: Mapping[str, Mapping[str, Any]],
    rank: str,
    *,
    strict: bool = False,
) -> None:
    """Raise :class:`WeightSyncError` unless every item fits ``layout``.

    Args:
        items: what the trainer sends to this rank.
        layout: the rank's ``get_parameter_layout()``:
            ``{name: {"shape": [...], "dtype": "bfloat16", ...}}``.
        rank: how to name the rank in messages (``"rank 1 (dp1 tp0)"``).
        strict: also require every parameter of the rank to be sent.
    """
    seen = set()
    for item in items:
        if item.name in seen:
            raise WeightSyncError(f"{item.name!r} is given twice for {rank}")
        seen.add(item.name)
        want = layout.get(item.name)
        if want is None:
            raise WeightSyncError(
                f"{rank} has no parameter {item.name!r}; {_close(item.name, layout)} "
                "Send the rollout model's parameter names (get_parameter_layout())."
            )
        want_shape = tuple(int(d) for d in want["shape"])
        want_dtype = dtype_name(want["dtype"])
        if item.shape != want_shape or item.dtype != want_dtype:
            fix = []
            if item.dtype != want_dtype:
                fix.append(f"cast with .to(torch.{want_dtype})")
            if item.shape != want_shape:
                fix.append(
                    "send this rank's own shard (tensors must already be in the "
                    "rollout layout: per-rank dict for TP > 1)"
                )
            raise WeightSyncError(
                f"layout mismatch for {item.name!r} on {rank}: the trainer sent "
                f"shape={list(item.shape)} dtype={item.dtype}, the rollout parameter is "
                f"shape={list(want_shape)} dtype={want_dtype}; " + " and ".join(fix)
            )
    if strict:
        missing = [n for n in layout if n not in seen]
        if missing:
            raise WeightSyncError(
                f"strict update: {len(missing)} parameters of {rank} are not sent, "
                f"e.g. {missing[:3]}; send them or pass strict=False"
            )


# --------------------------------------------------------------------------- #
# Grouping and bucketing
# --------------------------------------------------------------------------- #
def group_ranks(payload_ids: Sequence[Any]) -> List[List[int]]:
    """Ranks whose payload key is equal share buckets; groups in first-rank order."""
    groups: Dict[Any, List[int]] = {}
    for rank, key in enumerate(payload_ids):
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def plan_buckets(items: Sequence[TensorItem], bucket_bytes: int) -> List[Bucket]:
    """Cut ``items`` (in order) into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own (the buffer
    is sized for it, see :func:`plan_steps`). Order is kept, so the names of a
    bucket are its tensors' order in the ``ray.put`` list.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: List[Bucket] = []
    current = Bucket(0)
    offset = 0
    for item in items:
        if current.slices and offset + item.nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = Bucket(len(buckets)), 0
        current.slices.append(Slice(item.name, offset, item.nbytes, item.shape, item.dtype))
        offset = align_up(offset + item.nbytes)
    if current.slices:
        buckets.append(current)
    return buckets


def plan_steps(
    items_per_group: Sequence[Sequence[TensorItem]], bucket_bytes: int
) -> Tuple[List[Step], int]:
    """Plan an update: the steps and the buffer size one step needs.

    Each step holds bucket ``k`` of every group side by side in one buffer; the
    groups share ``bucket_bytes`` equally (each at least its largest tensor).
    A group with fewer buckets is absent from the later steps.

    Returns ``(steps, buffer_bytes)``: the client keeps two buffers of
    ``buffer_bytes`` (double buffering) across updates.
    """
    if not items_per_group:
        raise WeightSyncError("empty update: no tensors were given")
    share = max(ALIGN, bucket_bytes // len(items_per_group))
    per_group = [plan_buckets(items, share) for items in items_per_group]
    extents = [max((b.extent for b in buckets), default=0) for buckets in per_group]
    offsets, buffer_bytes = [], 0
    for extent in extents:
        offsets.append(buffer_bytes)
        buffer_bytes += align_up(extent)
    n_steps = max(len(b) for b in per_group)
    steps = []
    for k in range(n_steps):
        regions = [
            Region(g, offsets[g], buckets[k])
            for g, buckets in enumerate(per_group)
            if k < len(buckets)
        ]
        steps.append(Step(k, regions))
    return steps, buffer_bytes


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
