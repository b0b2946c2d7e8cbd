"""What a trainer hands to :meth:`WeightSyncClient.update`, normalised.

One mapping for every rank, or ``{rank: mapping}`` (reusing one mapping object
for ranks that take the same tensors, e.g. DP replicas of one TP shard, so
they share buckets).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer.buckets import TensorItem, check_tensors, dtype_name, group_ranks

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


def tensor_item(name: str, shape, dtype) -> TensorItem:
    """The bucket planner's view of one tensor (or one rank parameter's spec)."""
    shape = tuple(int(d) for d in shape)
    dtype = dtype_name(dtype)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise WeightSyncError(f"{name!r}: unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    return TensorItem(name, shape, dtype, numel * torch_dtype.itemsize)


def normalize(named: NamedTensors) -> Dict[str, torch.Tensor]:
    """``{name: detached tensor}``; refuses non-tensors, repeats and emptiness."""
    items = named.items() if isinstance(named, Mapping) else named
    out: Dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in out:
            raise WeightSyncError(f"{name!r} is given twice")
        # A tensor that records no autograd history (requires_grad False: no
        # grad_fn either) already is one: no new object per tensor.
        out[name] = t.detach() if t.requires_grad else t
    if not out:
        raise WeightSyncError("empty update: no tensors were given")
    return out


def split_payloads(named_tensors, n_ranks: int) -> Tuple[List[Dict[str, torch.Tensor]], List[List[int]]]:
    """Per-rank ``{name: tensor}`` and the groups of ranks sharing one."""
    if isinstance(named_tensors, Mapping) and named_tensors and all(
        isinstance(k, int) for k in named_tensors
    ):
        missing = [r for r in range(n_ranks) if r not in named_tensors]
        extra = [k for k in named_tensors if not 0 <= k < n_ranks]
        if missing or extra:
            raise WeightSyncError(
                f"a per-rank update needs tensors for ranks 0..{n_ranks - 1}: "
                + (f"missing {missing}" if missing else f"no such ranks {extra}")
            )
        per_rank = [named_tensors[r] for r in range(n_ranks)]
    else:
        per_rank = [named_tensors] * n_ranks
    normalized: Dict[int, Dict[str, torch.Tensor]] = {}
    for p in per_rank:
        if id(p) not in normalized:
            normalized[id(p)] = normalize(p)
    groups = group_ranks([id(p) for p in per_rank])
    return [normalized[id(p)] for p in per_rank], groups


def signature(payload: Mapping[str, torch.Tensor]) -> tuple:
    """What an update needs to know whether a rank group's tensors are the
    ones it saw last time: names, addresses, shapes, dtypes, strides (one
    pass; the layout check, the in-place checks and the kept ref of a
    zero-copy update all compare it)."""
    return tuple([(n, t.data_ptr(), t.shape, t.dtype, t.stride()) for n, t in payload.items()])


class Signatures:
    """The last update's signatures: an equal one is replaced by the object
    seen before, so every later comparison with a cached copy (layout check,
    in-place check, kept ref) is a pointer comparison per tensor instead of a
    field-by-field one."""

    def __init__(self):
        self._last: List[tuple] = []

    def intern(self, sigs: List[tuple]) -> List[tuple]:
        last = self._last
        out = [old if g < len(last) and (old := last[g]) == sig else sig
               for g, sig in enumerate(sigs)]
        self._last = out
        return out


def layout_of(sig: tuple) -> tuple:
    """The names, shapes and dtypes of a :func:`signature` (no addresses)."""
    return tuple((n, shape, dtype) for n, _, shape, dtype, _ in sig)


class LayoutCheck:
    """Checks each rank group's tensors against its ranks' layouts; an update
    with the same names, shapes and dtypes as the last one that passed the
    same (cached) layouts is not checked again — also when its tensors are new
    ones (other addresses), as a trainer that hands over fresh tensors every
    step has."""

    def __init__(self):
        # group index -> (signature, layouts, items, names/shapes/dtypes)
        self._passed: Dict[int, tuple] = {}

    def items_per_group(self, payloads, groups, layouts, labels, strict: bool,
                        sigs: Optional[Sequence[tuple]] = None) -> List[List[TensorItem]]:
        out = []
        for g, group in enumerate(groups):
            payload = payloads[group[0]]
            raw = sigs[g] if sigs is not None else signature(payload)
            sig = (tuple(group), strict, raw)
            cached = self._passed.get(g)
            if cached is not None and cached[1] is layouts and cached[0][:2] == sig[:2]:
                if cached[0] == sig:
                    out.append(cached[2])
                    continue
                layout = layout_of(raw)
                if layout == cached[3]:
                    self._passed[g] = (sig, layouts, cached[2], layout)
                    out.append(cached[2])
                    continue
            items = [tensor_item(n, t.shape, t.dtype) for n, t in payload.items()]
            for r in group:
                check_tensors(items, layouts[r], labels[r], strict=strict)
            self._passed[g] = (sig, layouts, items, layout_of(raw))
            out.append(items)
        return out
