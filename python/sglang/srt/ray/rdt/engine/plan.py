"""Where each pulled tensor lands: pure checks over names, shapes and dtypes.

Every source is checked before any is read, so a rejected pull touches no weight; :class:`PlanCache` keeps plans."""

from __future__ import annotations

import threading
from collections import abc
from itertools import accumulate, chain
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError, close_names, dtype_name


class TensorSpec(NamedTuple):
    """A pulled tensor's shape and dtype (a tuple: plan keys hash it in C)."""

    shape: Tuple[int, ...]
    dtype: Any  # torch.dtype (numpy dtypes are rejected by plan_pull)

    @classmethod
    def of(cls, entry) -> "TensorSpec":
        shape, dtype = entry
        return cls(tuple(map(int, shape)), dtype)

    def describe(self) -> str:
        return f"shape={list(self.shape)} dtype={dtype_name(self.dtype)}"


NamesArg = Union[Sequence[str], Sequence[Sequence[str]]]


def group_names(param_names: NamesArg, counts: Sequence[int]) -> List[List[str]]:
    """Split ``param_names`` (flat in the refs' tensor order, or one list per ref) into one list per ref."""
    if type(param_names) is list and len(counts) == 1 and len(param_names) == counts[0] and all(
            type(n) is str for n in param_names):
        return [list(param_names)]  # one ref, one flat list of names (miles' call)
    if isinstance(param_names, (str, bytes)) or not isinstance(param_names, abc.Sequence):
        raise WeightSyncError(
            f"param_names must be a list of names (or one list per ref), got {type(param_names).__name__}")
    total = sum(counts)
    if param_names and all(isinstance(n, abc.Sequence) and not isinstance(n, (str, bytes)) for n in param_names):
        groups = [list(g) for g in param_names]
        if len(groups) != len(counts):
            raise WeightSyncError(f"got {len(groups)} name lists for {len(counts)} refs; give one list "
                                  "per ref or one flat list in the refs' tensor order")
        for i, (g, c) in enumerate(zip(groups, counts)):
            if len(g) != c:
                raise WeightSyncError(f"ref {i} holds {c} tensors but {len(g)} names were given for it"
                                      + (f" (first extra name: {g[c]!r})" if len(g) > c else ""))
    else:
        flat = list(param_names)
        if len(flat) != total:
            detail = (f"first extra name: {flat[total]!r}" if len(flat) > total
                      else f"the refs' tensors past the names start at index {len(flat)}")
            raise WeightSyncError(f"too {'many' if len(flat) > total else 'few'} names: the refs hold {total} tensors "
                                  f"({'+'.join(map(str, counts))}) but {len(flat)} names were given ({detail})")
        groups = [flat[end - c : end] for c, end in zip(counts, accumulate(counts))]
    for n in chain.from_iterable(groups):
        if not isinstance(n, str):
            raise WeightSyncError(f"parameter names must be strings, got {n!r}")
    return groups


def _where(ref_idx: int, pos: int) -> str:
    return f"ref {ref_idx} tensor {pos}"


def plan_pull(specs_per_ref: Sequence[Sequence[TensorSpec]], names_per_ref: Sequence[Sequence[str]],
              params: Mapping[str, torch.Tensor]) -> List[List[torch.Tensor]]:
    """Return, per ref, the live tensors the ref's tensors must land in."""
    if not specs_per_ref:
        raise WeightSyncError("empty pull: no refs were given")
    seen: Dict[str, Tuple[int, int]] = {}
    targets: List[List[torch.Tensor]] = []
    for ref_idx, (specs, names) in enumerate(zip(specs_per_ref, names_per_ref)):
        assert len(specs) == len(names)
        out = []
        for pos, (spec, name) in enumerate(zip(specs, names)):
            if name in seen:
                raise WeightSyncError(f"duplicate parameter {name!r} ({_where(*seen[name])} and "
                                      f"{_where(ref_idx, pos)}); each parameter may be pulled once per call")
            seen[name] = (ref_idx, pos)
            param = params.get(name)
            if param is None:
                raise WeightSyncError(f"unknown parameter {name!r} ({_where(ref_idx, pos)}): the "
                                      f"rollout model has no such parameter; {close_names(name, params)}")
            target = param.data if isinstance(param, torch.nn.Parameter) else param
            if not isinstance(spec.dtype, torch.dtype):
                raise WeightSyncError(f"{name!r} ({_where(ref_idx, pos)}) was put as "
                                      f"{spec.describe()}: only torch tensors can be pulled into parameters")
            if target.shape != spec.shape or target.dtype != spec.dtype:  # (a Size is a tuple)
                actual = TensorSpec(tuple(target.shape), target.dtype)
                raise WeightSyncError(f"layout mismatch for {name!r} ({_where(ref_idx, pos)}): the trainer sent "
                                      f"{spec.describe()}, the rollout parameter is {actual.describe()}; send tensors "
                                      "in the rollout layout (dtype and TP shard of this rank)")
            if not target.is_contiguous():
                raise WeightSyncError(f"parameter {name!r} is not contiguous in the rollout model (strides "
                                      f"{list(target.stride())}); RDT can only write into contiguous storage")
            out.append(target)
        targets.append(out)
    return targets


def storage_key(t: torch.Tensor) -> tuple:
    """Identity of the storage a tensor lives in (what NIXL registers)."""
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.nbytes())


def unique_storages(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """One tensor per distinct storage (by address and size)."""
    out, seen = [], set()
    for t in tensors:
        key = storage_key(t)
        if key not in seen and key[2] > 0:
            seen.add(key)
            out.append(t)
    return out


MAX_CACHED_PLANS = 256  # pull plans kept (one per layout a trainer sends: the same few every update)


class CachedPlan:
    """The targets :func:`plan_pull` chose for one layout, and what each target parameter was when planned."""

    __slots__ = ("targets", "nbytes", "count", "_params", "_ptrs", "_specs")

    def __init__(self, targets: List[List[torch.Tensor]], params: Sequence[torch.Tensor], specs: Sequence[TensorSpec]):
        from sglang.srt.ray.rdt.transport.metadata import Targets

        self.targets = [Targets.of(ts) for ts in targets]
        self.nbytes = sum(int(t.nbytes.sum()) for t in self.targets)
        self.count = sum(len(ts) for ts in targets)
        self._params = list(params)
        # (a target is its parameter's data: the same address)
        self._ptrs = np.concatenate([t.ptrs for t in self.targets]) if self.targets else None
        self._specs = list(specs)

    def still_live(self) -> bool:
        """Every target parameter still has its planned address, shape and dtype, contiguous (the plan's
        views keep the old storage from being handed out again)."""
        from sglang.srt.ray.rdt.transport.metadata import addresses

        if self._ptrs is not None and not np.array_equal(addresses(self._params)[0], self._ptrs):
            return False
        return all(p.shape == s.shape and p.dtype == s.dtype and p.is_contiguous()
                   for p, s in zip(self._params, self._specs))


class PlanCache:
    """One walk of the model's live parameters and the pull plans made against it. After :meth:`mark_stale`
    (an update's end, an sglang weight load) plans survive the next walk only if their targets are unchanged;
    :meth:`forget` (memory release/resume, (de)registration, a failed pull) drops them. Its own lock guards it;
    pulls plan on the scheduler's thread under the receiver's lock (taken first)."""

    def __init__(self, get_params: Callable[[], Mapping[str, torch.Tensor]]):
        self._get_params = get_params
        self._lock = threading.RLock()
        self.params: Optional[Mapping[str, torch.Tensor]] = None
        self._plans: Dict[Any, CachedPlan] = {}
        self._stale = False  # walk again, but the plans may survive

    def forget(self) -> None:
        """Walk the model again at the next pull and plan every layout anew."""
        self.restart(None)

    def restart(self, params: Optional[Mapping[str, torch.Tensor]]) -> None:
        """Plan anew against ``params``, a walk made just now (the next pull does not walk again)."""
        with self._lock:
            self.params = params
            self._stale = False
            self._plans.clear()

    def mark_stale(self) -> None:
        with self._lock:
            if self.params is not None:  # (no walk yet: the next pull walks anyway)
                self._stale = True

    @property
    def stale(self) -> bool:
        """Whether the next pull must walk the model again first."""
        return self._stale

    def refresh(self) -> bool:
        """Walk again if stale, keeping only plans whose parameters are unchanged. Returns whether it walked."""
        with self._lock:
            if not self._stale:
                return False
            fresh = self._get_params()
            old, self._stale = self.params, False
            if old is None or fresh.keys() != old.keys() or any(fresh[n] is not old[n] for n in fresh):
                self._plans.clear()
            else:
                self._plans = {k: p for k, p in self._plans.items() if p.still_live()}
            self.params = fresh
            return True

    def param_names(self) -> List[str]:
        """The parameter names of the last walk (walks once if none yet)."""
        with self._lock:
            if self.params is None:
                self.params = self._get_params()
            return list(self.params)

    def plan(self, specs, names, key: Any = None) -> Tuple[CachedPlan, bool, bool]:
        """(plan, walked, reused) of a pull; ``key``: the layout's identity (a lane's layout id) or None."""
        with self._lock:
            walked = self.refresh()
            if key is None:
                key = (tuple(map(tuple, names)), tuple(map(tuple, specs)))
            plan = self._plans.get(key)
            if plan is not None:
                return plan, walked, True
            if self.params is None:
                self.params, walked = self._get_params(), True
            targets = plan_pull(specs, names, self.params)
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.clear()
            plan = self._plans[key] = CachedPlan(targets, [self.params[n] for ns in names for n in ns],
                                                 [sp for ss in specs for sp in ss])
            return plan, walked, False
