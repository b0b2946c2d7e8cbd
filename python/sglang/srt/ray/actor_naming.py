"""Names of the Ray backend's SchedulerActors, and how to rebuild them.

A trainer in another Ray job finds a rollout rank with ``ray.get_actor(name,
namespace=...)``, so the name must be computable from facts the trainer has:
the engine node's IP, the rank coordinates, the bundle index and the engine's
HTTP port. Two forms exist:

* discoverable (``--enable-rdt-weight-sync``, detached actors)::

    sglang_scheduler_node10.0.0.5_port30000_dp0_pp0_tp1_bundle0

  The port keeps several engines on one node apart; nothing random is in it.
* placement-group keyed (upstream's form, also ``launch_engine`` handles mode)::

    sglang_scheduler_node10.0.0.5_dp0_pp0_tp1_pg1a2b3c4d_bundle0

  It is unique per placement group but cannot be rebuilt without the group.

Example (trainer side)::

    from sglang.srt.ray import get_scheduler_actor_name
    name = get_scheduler_actor_name(rank0_node_ip="10.0.0.5", dp_rank=0, pp_rank=0,
                                    tp_rank=0, port=30000, bundle_idx=0)
    actor = ray.get_actor(name, namespace="rollout")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

PREFIX = "sglang_scheduler"

_NAME_RE = re.compile(
    rf"^{PREFIX}_node(?P<node_ip>.+?)"
    r"(?:_port(?P<port>\d+))?"
    r"_dp(?P<dp>\d+|None)_pp(?P<pp>\d+)_tp(?P<tp>\d+)"
    r"(?:_pg(?P<pg>[0-9a-f]+))?"
    r"_bundle(?P<bundle>\d+)$"
)


@dataclass(frozen=True)
class SchedulerActorName:
    node_ip: str
    dp_rank: Optional[int]
    pp_rank: int
    tp_rank: int
    bundle_index: int
    port: Optional[int] = None
    placement_group_id: Optional[str] = None

    def __str__(self) -> str:
        return get_scheduler_actor_name(
            rank0_node_ip=self.node_ip,
            dp_rank=self.dp_rank,
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            bundle_idx=self.bundle_index,
            port=self.port,
            placement_group_id=self.placement_group_id,
        )


def get_scheduler_actor_name(
    rank0_node_ip: Optional[str] = None,
    dp_rank: Optional[int] = None,
    pp_rank: int = 0,
    tp_rank: int = 0,
    bundle_idx: Optional[int] = None,
    *,
    port: Optional[int] = None,
    placement_group_id: Optional[str] = None,
    node_ip: Optional[str] = None,
    bundle_index: Optional[int] = None,
) -> str:
    """Build the Ray actor name of one SchedulerActor.

    The seed spelling (what miles calls)::

        get_scheduler_actor_name(rank0_node_ip="10.0.0.5", dp_rank=0, pp_rank=0,
                                 tp_rank=1, port=30000, bundle_idx=1)

    ``node_ip`` / ``bundle_index`` are accepted as other spellings of
    ``rank0_node_ip`` / ``bundle_idx`` (give one of each pair).

    Give ``port`` (the engine's HTTP port) for engines launched with
    ``--enable-rdt-weight-sync``, or ``placement_group_id`` (hex, as
    ``pg.id.hex()``; the first 8 characters are used) for placement-group keyed
    actors. Exactly one of them must be given.

    ``rank0_node_ip`` is the IP of the node that runs rank 0 of the engine (the
    node of the launching process), as Ray reports it
    (``ray.util.get_node_ip_address()``); every rank's name carries it, also
    ranks on other nodes. On a placement group with one bundle per rank (the
    caller's, or the engine's own with ``--ray-placement-strategy``) a DP
    group's names carry the IP of the node of that group's first rank instead
    (upstream's naming), and rank r is on bundle r (``bundle_idx=r``).
    """
    node_ip = _one_of("rank0_node_ip", rank0_node_ip, "node_ip", node_ip)
    bundle_index = _one_of("bundle_idx", bundle_idx, "bundle_index", bundle_index)
    if (port is None) == (placement_group_id is None):
        raise ValueError(
            "give exactly one of port= (discoverable engines, "
            "--enable-rdt-weight-sync) or placement_group_id="
        )
    if not node_ip or "_" in node_ip:
        raise ValueError(f"invalid node IP {node_ip!r}")
    for label, value in (("pp_rank", pp_rank), ("tp_rank", tp_rank), ("bundle_index", bundle_index)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{label} must be a non-negative int, got {value!r}")
    if dp_rank is not None and (not isinstance(dp_rank, int) or dp_rank < 0):
        raise ValueError(f"dp_rank must be a non-negative int or None, got {dp_rank!r}")
    ranks = f"_dp{dp_rank}_pp{pp_rank}_tp{tp_rank}"
    if port is not None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port must be a TCP port number, got {port!r}")
        return f"{PREFIX}_node{node_ip}_port{port}{ranks}_bundle{bundle_index}"
    return f"{PREFIX}_node{node_ip}{ranks}_pg{placement_group_id[:8]}_bundle{bundle_index}"


def _one_of(name: str, value, alias: str, alias_value):
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} disagree; give one")
    out = value if value is not None else alias_value
    if out is None:
        raise ValueError(f"{name} is required")
    return out


def parse_scheduler_actor_name(name: str) -> SchedulerActorName:
    """Inverse of :func:`get_scheduler_actor_name`; raises ``ValueError``."""
    m = _NAME_RE.match(name)
    if not m or (m["port"] is None) == (m["pg"] is None):
        raise ValueError(f"not a SchedulerActor name: {name!r}")
    return SchedulerActorName(
        node_ip=m["node_ip"],
        dp_rank=None if m["dp"] == "None" else int(m["dp"]),
        pp_rank=int(m["pp"]),
        tp_rank=int(m["tp"]),
        bundle_index=int(m["bundle"]),
        port=int(m["port"]) if m["port"] else None,
        placement_group_id=m["pg"],
    )


def is_scheduler_actor_name(name: str) -> bool:
    try:
        parse_scheduler_actor_name(name)
        return True
    except ValueError:
        return False
