"""Actor names of an engine's SchedulerActors: built, parsed, refused (sglang/srt/ray/actor_naming.py)."""

from __future__ import annotations


import pytest

from sglang.srt.ray import get_scheduler_actor_name
from sglang.srt.ray.actor_naming import (
    SchedulerActorName,
    is_scheduler_actor_name,
    parse_scheduler_actor_name,
)


# --------------------------------------------------------------------------- #
# Actor names
# --------------------------------------------------------------------------- #
def test_discoverable_name_is_rebuildable_and_has_no_pg():
    name = get_scheduler_actor_name("10.0.0.5", dp_rank=1, pp_rank=0, tp_rank=3, bundle_index=2, port=30000)
    assert name == "sglang_scheduler_node10.0.0.5_port30000_dp1_pp0_tp3_bundle2"
    parsed = parse_scheduler_actor_name(name)
    assert parsed == SchedulerActorName("10.0.0.5", 1, 0, 3, 2, port=30000)
    assert str(parsed) == name


def test_pg_keyed_name_matches_upstream_form():
    pg = "a8557c81ffee00112233"
    name = get_scheduler_actor_name("192.0.2.2", 0, 0, 0, 0, placement_group_id=pg)
    assert name == "sglang_scheduler_node192.0.2.2_dp0_pp0_tp0_pga8557c81_bundle0"
    p = parse_scheduler_actor_name(name)
    assert (p.placement_group_id, p.port) == ("a8557c81", None)


def test_ipv6_node_and_missing_dp_rank_round_trip():
    name = get_scheduler_actor_name("fe80::1", None, 1, 0, 0, port=8000)
    p = parse_scheduler_actor_name(name)
    assert (p.node_ip, p.dp_rank, p.pp_rank) == ("fe80::1", None, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(port=None, placement_group_id=None), "exactly one"),
        (dict(port=1, placement_group_id="ab"), "exactly one"),
        (dict(port=70000), "TCP port"),
        (dict(port=80, tp_rank=-1), "tp_rank"),
    ],
)
def test_name_rejects_ambiguous_or_bad_input(kwargs, match):
    base = dict(node_ip="1.2.3.4", dp_rank=0, pp_rank=0, tp_rank=0, bundle_index=0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        get_scheduler_actor_name(**base)


def test_parse_rejects_foreign_names():
    for bad in ["foo", "sglang_scheduler_node1.2.3.4_dp0_pp0_tp0_bundle0",
                "sglang_scheduler_node1_port1_dp0_pp0_tp0_pgab_bundle0"]:
        assert not is_scheduler_actor_name(bad)
        with pytest.raises(ValueError):
            parse_scheduler_actor_name(bad)
