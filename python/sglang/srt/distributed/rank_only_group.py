"""Group descriptors for a rank built outside the engine (see :mod:`.rank_parallelism`).

A :class:`RankOnlyGroup` answers what a ``GroupCoordinator`` says about one
rank's place in a group (its rank, the group's width and members) and holds
no communicator: a layer built against it slices its weights for that rank,
and any collective on it raises, naming the group. :func:`groups_of` lays out
every group of one rank as the engine builds them.
"""

from __future__ import annotations

from typing import Any, Dict, List

# Communicator handles a GroupCoordinator carries; a descriptor has none.
_NO_HANDLE = frozenset(
    {
        "cpu_group",
        "device_group",
        "pynccl_comm",
        "pymscclpp_comm",
        "ca_comm",
        "qr_comm",
        "torch_symm_mem_comm",
        "mq_broadcaster",
        "npu_communicator",
        "xpu_communicator",
        "hpu_communicator",
        "pynccl_symm_comm",
    }
)

# Operations that need a process group: calling one on a descriptor is an error.
_COLLECTIVES = (
    "all_reduce",
    "quant_all_reduce",
    "fused_allreduce_rmsnorm",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_along_dim",
    "reduce_scatterv",
    "all_gather",
    "all_gatherv",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all_single",
    "gather",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "send",
    "recv",
    "send_object",
    "recv_object",
    "send_tensor_dict",
    "recv_tensor_dict",
    "send_recv_tensor_dict",
    "barrier",
    "graph_capture",
    "destroy",
)


class RankOnlyGroup:
    """Answers one rank's place in a group, with no process group behind it.

    It has what building a model reads from a ``GroupCoordinator``
    (``rank_in_group``, ``world_size``, ``ranks``, ``is_first_rank`` ...);
    communicator handles (``cpu_group``, ``device_group``, ``pynccl_comm`` ...)
    are ``None`` and ``use_*`` hints are ``False``. Collectives raise
    ``RuntimeError``: a replica built from a descriptor is for loading and
    reading weights, not for running a forward pass that communicates.
    """

    def __init__(
        self,
        name: str,
        rank_in_group: int,
        world_size: int,
        ranks: List[int],
        local_rank: int = 0,
        owner: str = "",
    ):
        if not 0 <= rank_in_group < world_size or len(ranks) != world_size:
            raise ValueError(
                f"RankOnlyGroup {name!r}: rank {rank_in_group} of {world_size} "
                f"with ranks {ranks}"
            )
        self.unique_name = f"{name}:rank-only"
        self.group_name = name
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.ranks = list(ranks)
        self.rank = self.ranks[rank_in_group]
        self.local_rank = local_rank
        self._owner = owner

    # The GroupCoordinator properties that are pure arithmetic on the ranks.
    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def __getattr__(self, name: str):
        # Only reached for names not set above.
        if name in _NO_HANDLE:
            return None
        if name.startswith("use_"):
            return False
        raise AttributeError(
            f"RankOnlyGroup {self.group_name!r} ({self._owner}) has no {name!r}: "
            "it describes a rank's place in the group for building its model "
            "replica and has no process group"
        )

    def __repr__(self) -> str:
        return (
            f"RankOnlyGroup({self.group_name!r}, rank_in_group={self.rank_in_group}, "
            f"world_size={self.world_size}, ranks={self.ranks})"
        )


def _collective(op: str):
    def refuse(self, *args, **kwargs):
        raise RuntimeError(
            f"{op}() on RankOnlyGroup {self.group_name!r} ({self._owner}): a model "
            "built under ParallelismContext describes one engine rank's layout and "
            "has no process group to communicate over"
        )

    refuse.__name__ = op
    return refuse


for _op in _COLLECTIVES:
    setattr(RankOnlyGroup, _op, _collective(_op))
del _op


def strided(name, rank_in_group, size, stride, world_rank, local_rank, owner):
    base = world_rank - rank_in_group * stride
    ranks = [base + i * stride for i in range(size)]
    return RankOnlyGroup(name, rank_in_group, size, ranks, local_rank, owner)


def groups_of(lay: Dict[str, int], local_rank: int, owner: str) -> Dict[str, Any]:
    """The group descriptors of one rank, laid out as the engine builds them."""
    w = lay["world_rank"]

    def g(name, rank_key, size_key, stride):
        return strided(name, lay[rank_key], lay[size_key], stride, w, local_rank, owner)

    return {
        "world_group": RankOnlyGroup(
            "world", w, lay["world_size"], list(range(lay["world_size"])), local_rank, owner
        ),
        # TP groups are contiguous blocks; PP groups are strided by tp_size.
        "tp_group": g("tp", "tp_rank", "tp_size", 1),
        "pp_group": g("pp", "pp_rank", "pp_size", lay["tp_size"]),
        # Inside a TP block: (attn_dp, attn_cp, attn_tp), attention TP fastest.
        "attn_tp_group": g("attention_tp", "attn_tp_rank", "attn_tp_size", 1),
        "attn_cp_group": g("attention_cp", "attn_cp_rank", "attn_cp_size", lay["attn_tp_size"]),
        # (moe_dp, moe_ep, moe_tp), MoE TP fastest.
        "moe_tp_group": g("moe_tp", "moe_tp_rank", "moe_tp_size", 1),
        "moe_ep_group": g("moe_ep", "moe_ep_rank", "moe_ep_size", lay["moe_tp_size"]),
        "moe_dp_group": g(
            "moe_dp", "moe_dp_rank", "moe_dp_size", lay["tp_size"] // lay["moe_dp_size"]
        ),
    }
