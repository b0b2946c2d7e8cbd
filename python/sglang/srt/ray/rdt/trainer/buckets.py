"""Pure planning of an update: rank groups, groups, layout checks, slot layout. No Ray, NIXL or GPU here."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError, close_names, dtype_name
from sglang.srt.ray.rdt.transport import tensor_scan
from sglang.srt.ray.rdt.transport.tensor_scan import Scan

# Offsets inside a slot are multiples of this (every dtype's alignment, a cache line).
ALIGN = 256
# A group size that keeps each rank group's tensors in one group.
WHOLE = sys.maxsize


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _checked(name, t):
    if not isinstance(t, torch.Tensor):
        raise WeightSyncError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    return t.detach() if t.requires_grad else t


def normalize(named) -> Dict[str, torch.Tensor]:
    """``{name: detached tensor}``; refuses non-tensors, repeats and emptiness."""
    return dict(stream_items(named.items() if isinstance(named, Mapping) else named))


def is_stream(named) -> bool:
    """Whether ``named`` is an iterator (made as it is consumed), not a collection."""
    return isinstance(named, Iterator)


def stream_items(named) -> Iterator[Tuple[str, torch.Tensor]]:
    """An iterator's ``(name, tensor)`` pairs, each checked as it comes."""
    seen = set()
    for name, t in named:
        if name in seen:
            raise WeightSyncError(f"{name!r} is given twice")
        seen.add(name)
        yield name, _checked(name, t)
    if not seen:
        raise WeightSyncError("empty update: no tensors were given")


def group_ranks(payload_ids: Sequence[Any]) -> List[List[int]]:
    """Ranks whose payload key is equal share groups; rank groups in first-rank order."""
    groups: Dict[Any, List[int]] = {}
    for rank, key in enumerate(payload_ids):
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def split_payloads(named, n_ranks: int):
    """``(payloads, rank_groups)``: each rank group's tensors (an iterator's checked pairs) and its ranks."""
    if is_stream(named):
        return [stream_items(named)], [list(range(n_ranks))]
    if isinstance(named, Mapping) and named and all(isinstance(k, int) for k in named):
        missing = [r for r in range(n_ranks) if r not in named]
        extra = [k for k in named if not 0 <= k < n_ranks]
        if missing or extra:
            raise WeightSyncError(
                f"a per-rank update needs tensors for ranks 0..{n_ranks - 1}: "
                + (f"missing {missing}" if missing else f"no such ranks {extra}"))
        per_rank = [named[r] for r in range(n_ranks)]
    else:
        per_rank = [named] * n_ranks
    if any(is_stream(p) for p in per_rank) and len({id(p) for p in per_rank}) > 1:
        raise WeightSyncError("a per-rank update takes mappings, not iterators")
    rank_groups = group_ranks([id(p) for p in per_rank])
    payloads = [per_rank[g[0]] for g in rank_groups]
    # A mapping is read as it is (each tensor checked when it is cut); pairs become one.
    return [p if isinstance(p, Mapping) else normalize(p) for p in payloads], rank_groups


@dataclass
class Group:
    """Consecutive tensors of one rank group, sent in one transfer."""

    index: int
    names: List[str] = field(default_factory=list)
    tensors: List[torch.Tensor] = field(default_factory=list)
    scan: Optional[Scan] = None  # what the tensors are (set once the group is complete)
    nbytes: int = 0
    layout: int = -1  # its layout id (LayoutBook)

    def specs(self) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
        return list(zip(self.scan.shapes(), self.scan.dtypes()))


def cut(items, group_bytes: int) -> Iterator[Group]:
    """Cut ``(name, tensor)`` pairs or a mapping, in order, into groups of at most ``group_bytes`` (a larger
    tensor alone), each handed out once complete and scanned in one call."""
    if group_bytes <= 0:
        raise ValueError(f"group_bytes must be positive, got {group_bytes}")
    if isinstance(items, Mapping):
        items = whole(items)
    if isinstance(items, Group):  # (a whole mapping, looked at already)
        yield from _cut_whole(items, group_bytes)
        return
    current = Group(0)
    for name, t in items:
        if type(t) is not torch.Tensor or t.requires_grad:
            t = _checked(name, t)
        n = t.nbytes
        if current.names and current.nbytes + n > group_bytes:
            yield _scanned(current)
            current = Group(current.index + 1)
        current.names.append(name)
        current.tensors.append(t)
        current.nbytes += n
    if current.names:
        yield _scanned(current)
    elif current.index == 0:
        raise WeightSyncError("empty update: no tensors were given")


def _scanned(group: Group) -> Group:
    group.scan = _scan(group.names, group.tensors)
    return group


def _scan(names: List[str], tensors: List[torch.Tensor]) -> Scan:
    try:
        return tensor_scan.scan(tensors)
    except tensor_scan.NotATensor as e:
        _checked(names[e.index], tensors[e.index])  # (raises, naming it)
        raise


def whole(payload: Mapping[str, torch.Tensor]) -> Group:
    """A mapping as one group, looked at once (cut further with :func:`steps`)."""
    names, tensors = list(payload), list(payload.values())
    if not names:
        raise WeightSyncError("empty update: no tensors were given")
    s = _scan(names, tensors)  # (a tensor's autograd state does not matter here)
    return Group(0, names, tensors, s, int(s.nbytes.sum()))


def _cut_whole(g: Group, group_bytes: int) -> Iterator[Group]:
    names, tensors, s = g.names, g.tensors, g.scan
    if group_bytes == WHOLE:
        yield Group(0, names, tensors, s, g.nbytes)
        return
    ends = np.cumsum(s.nbytes)  # a group ends before the tensor that would take it past group_bytes
    start, index = 0, 0
    while start < len(names):
        base = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, base + group_bytes, side="right")))
        yield Group(index, names[start:stop], tensors[start:stop], s.part(start, stop), int(ends[stop - 1]) - base)
        start, index = stop, index + 1


def steps(payloads, rank_groups, group_bytes: int) -> Iterator[List[Tuple[int, Group]]]:
    """Step ``k``: group ``k`` of every rank group, ``[(rank group, group)]``; not held once the next is asked for."""
    share = WHOLE if group_bytes == WHOLE else max(ALIGN, group_bytes // len(rank_groups))
    cuts = [cut(p, share) for p in payloads]
    live = list(range(len(cuts)))
    while live:
        step = []
        for g in list(live):
            group = next(cuts[g], None)
            if group is None:
                live.remove(g)
            else:
                step.append((g, group))
        if step:
            yield step
        step = None


def slot_layout(step: Sequence[Tuple[int, Group]]) -> Tuple[List[List[int]], int]:
    """Aligned byte offsets of every tensor of ``step`` inside one slot, and the bytes the step needs."""
    offsets, at = [], 0
    for _, group in step:
        room = align_up(group.scan.nbytes)
        ends = at + np.cumsum(room)
        offsets.append((ends - room).tolist())
        at = int(ends[-1]) if len(ends) else at
    return offsets, at


def slot_bytes_for(layouts: Sequence[Sequence[int]], group_bytes: int) -> int:
    """A slot size for any step of tensors of these byte sizes (a list per rank group) cut into ``group_bytes``,
    in any order: per rank group, its share plus alignment, or its largest tensor, at most all its tensors."""
    share = max(ALIGN, group_bytes // max(len(layouts), 1))
    need = 0
    for sizes in layouts:
        room = [align_up(int(n)) for n in sizes]
        need += min(sum(room), max(max(room, default=0), share + ALIGN * len(room)))
    return need


def check_tensors(names: Sequence[str], shapes, dtypes, layout: Mapping[str, Mapping[str, Any]], rank: str) -> None:
    """Raise :class:`WeightSyncError` unless every tensor fits the rank's ``get_parameter_layout()``."""
    want_of = expected_specs(layout)
    for name, shape, dtype in zip(names, shapes, dtypes):
        want = want_of.get(name)
        if want is None:
            fix = ("Register the LoRA adapter first (register_lora_adapter); if another process registered it, "
                   "refresh this client's layouts (parameter_layouts(refresh=True))." if ":" in name else
                   "Send the rollout model's parameter names (get_parameter_layout()).")
            raise WeightSyncError(f"{rank} has no parameter {name!r}; {close_names(name, layout)} {fix}")
        if shape != want[0] or dtype != want[2]:
            _mismatch(name, shape, dtype, want, rank)


# id(layout) -> (layout, specs): a rank's layout is the same object until the client fetches it again.
_expected_cache: Dict[int, Tuple[Mapping[str, Any], Dict[str, tuple]]] = {}


def expected_specs(layout: Mapping[str, Mapping[str, Any]]) -> Dict[str, tuple]:
    """``{name: (shape, dtype name, torch dtype or None)}`` of a rank's layout, read once per layout object."""
    hit = _expected_cache.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    out = {}
    for name, want in layout.items():
        dname = dtype_name(want["dtype"])
        dtype = getattr(torch, dname, None)
        out[name] = (tuple(int(d) for d in want["shape"]), dname, dtype if isinstance(dtype, torch.dtype) else None)
    if len(_expected_cache) >= 64:
        _expected_cache.clear()
    _expected_cache[id(layout)] = (layout, out)
    return out


def _mismatch(name: str, shape, dtype, want: tuple, rank: str) -> None:
    want_shape, want_dtype = want[0], want[1]
    got_dtype = dtype_name(dtype)
    if tuple(shape) == want_shape and got_dtype == want_dtype:
        return  # (a dtype this torch does not name the same way)
    fix = []
    if got_dtype != want_dtype:
        fix.append(f"cast with .to(torch.{want_dtype})")
    if tuple(shape) != want_shape:
        fix.append("send this rank's own shard (tensors must already be in the rollout "
                   "layout: per-rank dict for TP > 1)")
    raise WeightSyncError(
        f"layout mismatch for {name!r} on {rank}: the trainer sent shape={list(shape)} "
        f"dtype={got_dtype}, the rollout parameter is shape={list(want_shape)} "
        f"dtype={want_dtype}; " + " and ".join(fix))


def check_strict(sent: Iterable[str], layout: Mapping[str, Any], rank: str) -> None:
    """A strict update sends every parameter of the rank."""
    sent = set(sent)
    missing = [n for n in layout if n not in sent and ":" not in n]  # (a LoRA adapter's are not the model's)
    if missing:
        raise WeightSyncError(f"strict update: {len(missing)} parameters of {rank} are not sent, "
                              f"e.g. {missing[:3]}; send them or pass strict=False")


class LayoutBook:
    """Layouts that passed the checks, per (rank group, group index). A group equal to the last one is not
    checked again; its layout id is what the lanes know it by."""

    def __init__(self):
        self._last: Dict[Tuple[int, int], Tuple[List[str], Scan, int]] = {}
        self._ids = itertools.count(1)
        self.layouts = None  # the rank layouts the cached checks were made against

    def assign(self, rank_group: int, group: Group, ranks: Sequence[int], layouts, labels) -> int:
        key = (rank_group, tuple(ranks), group.index)  # (the same group index may go to other ranks next time)
        last = self._last.get(key)
        if (last is not None and self.layouts is layouts and last[0] == group.names
                and group.scan.same_layout(last[1])):
            group.layout = last[2]
            return group.layout
        shapes, dtypes = group.scan.shapes(), group.scan.dtypes()
        for r in ranks:
            check_tensors(group.names, shapes, dtypes, layouts[r], labels[r])
        if self.layouts is not layouts:
            self._last.clear()
            self.layouts = layouts
        group.layout = next(self._ids)
        self._last[key] = (list(group.names), group.scan, group.layout)
        return group.layout
