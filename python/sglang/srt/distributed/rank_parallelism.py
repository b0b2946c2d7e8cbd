"""Build one engine rank's model layout in a process that is not that rank.

A trainer that pushes weights into an sglang engine has to hand every engine
rank the bytes of *its* shard: the rows of ``qkv_proj`` that rank's TP slot
owns, the experts its EP slot holds, the vocabulary range of its embedding.
The simplest exact way to get that layout is to let sglang build the model
itself, as if it were that rank, and to load the trainer's Hugging Face tensors
with the model's own ``load_weights``. This module provides the "as if it were
that rank" part:

* :class:`RankParallelismConfig` -- one rank's place in the engine's layout.
  ``from_dict`` reads the JSON an engine serves at
  ``GET /parallelism_config?rank=R`` (see
  ``sglang/srt/model_executor/parallelism_config.py``); ``to_dict`` writes it
  back unchanged.
* :class:`ParallelismContext` -- inside ``with ParallelismContext(cfg):``,
  ``get_parallel()`` answers that rank's TP/PP/DP/attention/MoE ranks and
  widths, and its groups are :class:`RankOnlyGroup` descriptors, so
  ``get_model(...)`` builds exactly that rank's shards with no process group
  and no ``torch.distributed`` initialization. Everything is put back on exit,
  also when the block raises.

The layers keep the group descriptor they were built with, so the weight
loaders of a model built inside the context keep slicing for that rank after
the ``with`` block ends (``model.load_weights(...)`` may run outside it).

Thread-safety: the parallel state is process-global (``runtime_context``), so
the context holds a process-wide re-entrant lock from ``__enter__`` to
``__exit__``. Another thread entering a ``ParallelismContext`` waits until the
first one exits; the same thread may nest contexts (the innermost rank is in
effect, the outer one comes back when the inner exits). Code on other threads
that reads ``get_parallel()`` *without* entering a context is not serialized
and sees the overridden rank while a context is open: do not build replicas in
a process that is serving at the same time.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Union

from sglang.srt.distributed.rank_only_group import RankOnlyGroup, groups_of, strided

__all__ = [
    "ParallelismContext",
    "RankOnlyGroup",
    "RankParallelismConfig",
]

# The rank/width pairs of the served JSON, in its order.
_RANK_AND_SIZE = (
    ("tp_rank", "tp_size"),
    ("pp_rank", "pp_size"),
    ("dp_rank", "dp_size"),
    ("attn_tp_rank", "attn_tp_size"),
    ("attn_dp_rank", "attn_dp_size"),
    ("attn_cp_rank", "attn_cp_size"),
    ("moe_ep_rank", "moe_ep_size"),
    ("moe_tp_rank", "moe_tp_size"),
    ("moe_dp_rank", "moe_dp_size"),
    ("node_rank", "nnodes"),
    ("world_rank", "world_size"),
)
_INT_FIELDS = tuple(name for pair in _RANK_AND_SIZE for name in pair) + (
    "device_id",
    "rank",
)
_STR_FIELDS = ("device",)


def _check_int(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"RankParallelismConfig.{name} must be an int or None, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class RankParallelismConfig:
    """One engine rank's place in the engine's parallel layout.

    The fields are those of the engine's ``/parallelism_config`` JSON. A value
    the engine could not read is ``None`` there and stays ``None`` here (so
    ``to_dict`` gives back what ``from_dict`` read); :meth:`layout` fills what
    can be derived from the rest when the rank is built. Keys this version does
    not know are kept in ``extra`` and written back by ``to_dict``, so a newer
    engine's JSON still loads.
    """

    tp_rank: Optional[int] = None
    tp_size: Optional[int] = None
    pp_rank: Optional[int] = None
    pp_size: Optional[int] = None
    dp_rank: Optional[int] = None
    dp_size: Optional[int] = None
    attn_tp_rank: Optional[int] = None
    attn_tp_size: Optional[int] = None
    attn_dp_rank: Optional[int] = None
    attn_dp_size: Optional[int] = None
    attn_cp_rank: Optional[int] = None
    attn_cp_size: Optional[int] = None
    moe_ep_rank: Optional[int] = None
    moe_ep_size: Optional[int] = None
    moe_tp_rank: Optional[int] = None
    moe_tp_size: Optional[int] = None
    moe_dp_rank: Optional[int] = None
    moe_dp_size: Optional[int] = None
    node_rank: Optional[int] = None
    nnodes: Optional[int] = None
    world_rank: Optional[int] = None
    world_size: Optional[int] = None
    device: Optional[str] = None
    device_id: Optional[int] = None
    rank: Optional[int] = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        for name in _INT_FIELDS:
            _check_int(name, getattr(self, name))
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"RankParallelismConfig.{name} must be a str or None, got {value!r}"
                )
        for rank_name, size_name in _RANK_AND_SIZE:
            rank, size = getattr(self, rank_name), getattr(self, size_name)
            if size is not None and size < 1:
                raise ValueError(f"RankParallelismConfig.{size_name}={size} must be >= 1")
            if rank is not None and rank < 0:
                raise ValueError(f"RankParallelismConfig.{rank_name}={rank} must be >= 0")
            if rank is not None and size is not None and rank >= size:
                raise ValueError(
                    f"RankParallelismConfig: {rank_name}={rank} is not a rank of "
                    f"{size_name}={size}"
                )
        object.__setattr__(self, "extra", dict(self.extra))

    # ------------------------------------------------------------------ JSON

    @classmethod
    def field_names(cls) -> List[str]:
        """The JSON keys this class reads, in the served order."""
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankParallelismConfig":
        """Read one rank's ``/parallelism_config`` JSON (unknown keys go to ``extra``)."""
        if not isinstance(data, Mapping):
            raise TypeError(
                "RankParallelismConfig.from_dict expects the JSON object of one rank "
                f"(GET /parallelism_config?rank=R), got {type(data).__name__}"
            )
        if "ranks" in data and "tp_size" not in data:
            raise ValueError(
                "RankParallelismConfig.from_dict got the all-ranks listing "
                "({'ranks': {...}}); pass one rank's entry, e.g. data['ranks'][str(R)]"
            )
        known = set(cls.field_names())
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object ``from_dict`` reads: every known key, then ``extra``."""
        out = {name: getattr(self, name) for name in self.field_names()}
        out.update(self.extra)
        return out

    # ---------------------------------------------------------------- layout

    def layout(self) -> Dict[str, int]:
        """Every rank and width of this rank, missing ones derived.

        Widths default to 1 (``tp_size`` too); a width's rank defaults to 0
        when the width is 1. Attention and MoE ranks are derived from
        ``tp_rank`` the way the engine lays them out (TP blocks of
        ``(attn_dp, attn_cp, attn_tp)``, attention TP fastest; MoE
        ``(moe_dp, moe_ep, moe_tp)``, MoE TP fastest); the WORLD rank is
        ``pp_rank * tp_size + tp_rank``. ``dp_rank`` stays ``None`` when the
        engine has no data-parallel controller. Raises ``ValueError`` naming
        the field when a rank cannot be derived or the widths do not factor.
        """
        v = {name: getattr(self, name) for name in _INT_FIELDS}

        def width(name: str) -> int:
            return 1 if v[name] is None else v[name]

        def given_rank(axis: str) -> int:
            size, rank = width(f"{axis}_size"), v[f"{axis}_rank"]
            if rank is None and size > 1:
                raise ValueError(
                    f"RankParallelismConfig: {axis}_rank is missing but {axis}_size={size}"
                )
            return 0 if rank is None else rank

        tp_size, tp_rank = width("tp_size"), given_rank("tp")
        pp_size, pp_rank = width("pp_size"), given_rank("pp")

        attn_dp_size, attn_cp_size = width("attn_dp_size"), width("attn_cp_size")
        attn_tp_size = v["attn_tp_size"]
        if attn_tp_size is None:
            attn_tp_size = tp_size // (attn_dp_size * attn_cp_size) or 1
        moe_ep_size, moe_dp_size = width("moe_ep_size"), width("moe_dp_size")
        moe_tp_size = v["moe_tp_size"]
        if moe_tp_size is None:
            moe_tp_size = tp_size // (moe_ep_size * moe_dp_size) or 1

        problems = []
        if attn_tp_size * attn_dp_size * attn_cp_size != tp_size:
            problems.append(
                f"tp_size={tp_size} != attn_tp_size={attn_tp_size} * "
                f"attn_dp_size={attn_dp_size} * attn_cp_size={attn_cp_size}"
            )
        if moe_tp_size * moe_ep_size * moe_dp_size != tp_size:
            problems.append(
                f"tp_size={tp_size} != moe_tp_size={moe_tp_size} * "
                f"moe_ep_size={moe_ep_size} * moe_dp_size={moe_dp_size}"
            )
        if problems:
            raise ValueError(
                "RankParallelismConfig: the widths do not factor the TP group: "
                + "; ".join(problems)
            )

        def rank_or(name: str, derived: int) -> int:
            return derived if v[name] is None else v[name]

        def block_ranks(prefix: str, middle: str, fast: int, mid: int) -> Dict[str, int]:
            """Ranks in TP blocks of ``(dp, middle, tp)`` of a sub-layout, its TP fastest."""
            derived = {"tp": tp_rank % fast, middle: (tp_rank // fast) % mid, "dp": tp_rank // (fast * mid)}
            return {f"{prefix}_{k}_rank": rank_or(f"{prefix}_{k}_rank", r) for k, r in derived.items()}

        out = {
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
            "dp_size": width("dp_size"),
            "attn_tp_size": attn_tp_size,
            "attn_dp_size": attn_dp_size,
            "attn_cp_size": attn_cp_size,
            **block_ranks("attn", "cp", attn_tp_size, attn_cp_size),
            "moe_ep_size": moe_ep_size,
            "moe_tp_size": moe_tp_size,
            "moe_dp_size": moe_dp_size,
            **block_ranks("moe", "ep", moe_tp_size, moe_ep_size),
            "nnodes": width("nnodes"),
            "node_rank": rank_or("node_rank", 0),
            "world_size": rank_or("world_size", tp_size * pp_size),
            "world_rank": rank_or("world_rank", pp_rank * tp_size + tp_rank),
        }
        out["dp_rank"] = v["dp_rank"]
        for rank_name, size_name in _RANK_AND_SIZE:
            rank = out[rank_name]
            if rank is not None and not 0 <= rank < out[size_name]:
                raise ValueError(
                    f"RankParallelismConfig: {rank_name}={rank} is not a rank of "
                    f"{size_name}={out[size_name]}"
                )
        return out

    def describe(self) -> str:
        """A short label for messages, e.g. ``rank 3 (tp 1/2, pp 1/2)``."""
        lay = self.layout()
        label = f"tp {lay['tp_rank']}/{lay['tp_size']}"
        if lay["pp_size"] > 1:
            label += f", pp {lay['pp_rank']}/{lay['pp_size']}"
        if lay["moe_ep_size"] > 1:
            label += f", ep {lay['moe_ep_rank']}/{lay['moe_ep_size']}"
        if lay["attn_dp_size"] > 1:
            label += f", attn-dp {lay['attn_dp_rank']}/{lay['attn_dp_size']}"
        rank = self.rank if self.rank is not None else lay["world_rank"]
        return f"rank {rank} ({label})"


# ---------------------------------------------------------------------------
# The context
# ---------------------------------------------------------------------------

_LOCK = threading.RLock()


class ParallelismContext:
    """``with ParallelismContext(cfg):`` -- sglang sees the rank ``cfg`` describes.

    Inside the block, ``get_parallel()`` (and the legacy
    ``get_tensor_model_parallel_rank()``-style getters, which read its groups)
    answer the rank's TP/PP/DP, attention TP/DP/CP and MoE EP/TP/DP ranks and
    widths, its node and WORLD rank, and :class:`RankOnlyGroup` descriptors
    for its groups. Nothing else is changed: configuration that is not about
    the rank's place (model, dtype, quantization, MoE backend ...) is read from
    the published ``ServerArgs`` as usual, so publish the engine's server args
    first (``set_global_server_args_for_scheduler``).

    ``cfg`` is a :class:`RankParallelismConfig` or its JSON dict. The context
    is re-entrant and nestable (see the module docstring for threads); on exit
    -- normal or by exception -- the previous parallel state is restored.
    """

    def __init__(self, config: Union[RankParallelismConfig, Mapping[str, Any]]):
        if not isinstance(config, RankParallelismConfig):
            config = RankParallelismConfig.from_dict(config)
        self.config = config
        # Validate (and derive) now, so a bad config fails at construction.
        self._layout = config.layout()
        self._stacks: List[contextlib.ExitStack] = []

    def overrides(self) -> Dict[str, Any]:
        """The ``get_parallel()`` values the context installs (ranks, widths, groups)."""
        lay = self._layout
        owner = self.config.describe()
        local_rank = self.config.device_id if self.config.device_id is not None else 0
        values: Dict[str, Any] = {
            "tp_rank": lay["tp_rank"],
            "tp_size": lay["tp_size"],
            "pp_rank": lay["pp_rank"],
            "pp_size": lay["pp_size"],
            "dp_rank": lay["dp_rank"],
            "dp_size": lay["dp_size"],
            "attn_tp_rank": lay["attn_tp_rank"],
            "attn_tp_size": lay["attn_tp_size"],
            "attn_dp_rank": lay["attn_dp_rank"],
            "attn_dp_size": lay["attn_dp_size"],
            "attn_cp_rank": lay["attn_cp_rank"],
            "attn_cp_size": lay["attn_cp_size"],
            "moe_ep_rank": lay["moe_ep_rank"],
            "moe_ep_size": lay["moe_ep_size"],
            "moe_tp_rank": lay["moe_tp_rank"],
            "moe_tp_size": lay["moe_tp_size"],
            "moe_dp_rank": lay["moe_dp_rank"],
            "moe_dp_size": lay["moe_dp_size"],
            "node_rank": lay["node_rank"],
            "nnodes": lay["nnodes"],
            "launch_world_rank": lay["world_rank"],
            "launch_world_size": lay["world_size"],
        }
        if lay["attn_dp_size"] > 1:
            values["attn_dp_enabled"] = True
        values.update(groups_of(lay, local_rank, owner))
        values.update(self._shared_experts_group(lay, local_rank, owner))
        return values

    @staticmethod
    def _shared_experts_group(lay, local_rank, owner) -> Dict[str, Any]:
        """The shared-expert TP group, from the published width (None when unset)."""
        from sglang.srt.runtime_context import get_parallel

        try:
            size = get_parallel().shared_experts_tp_size
        except Exception:
            size = None
        if not size or size <= 1:
            return {"shared_experts_tp_group": None}
        # Contiguous blocks of `size` ranks inside the attention-TP group.
        return {
            "shared_experts_tp_group": strided(
                "shared_experts_tp",
                lay["world_rank"] % size,
                size,
                1,
                lay["world_rank"],
                local_rank,
                owner,
            )
        }

    def __enter__(self) -> "ParallelismContext":
        from sglang.srt.runtime_context import get_parallel

        stack = contextlib.ExitStack()
        stack.enter_context(_LOCK)
        try:
            try:
                stack.enter_context(get_parallel().override(**self.overrides()))
            except ValueError as e:
                raise ValueError(
                    f"ParallelismContext({self.config.describe()}): {e}"
                ) from e
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._stacks.pop().close()

    def __repr__(self) -> str:
        return f"ParallelismContext({self.config.describe()})"
