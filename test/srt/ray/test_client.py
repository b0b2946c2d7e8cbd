"""WeightSyncClient: its planning, bucket sender, routes, metrics and ``make demo``.

* pure: cutting updates into groups, slot layouts, layout checks, the
  sender's in-flight guard, metrics with a fake backend (no Ray);
* toy ranks (real Ray head, real NIXL, the product's standalone rank over a
  toy model, no server): buckets with a slow rank, direct reads, fresh and
  streamed tensors (bytes and how much the client holds), lane and Ray
  routes, a failing, a dead and a dying rank, rejected tensors, per-rank
  tensors, the engine session;
* slow: the client against a live CPU server (CLI), metrics on Ray's
  Prometheus endpoint, and ``make demo``.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import requests
import torch

from conftest import wait_until

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer import buckets
from sglang.srt.ray.rdt.trainer import sender as sender_module
from sglang.srt.ray.rdt.trainer.buckets import ALIGN, LayoutBook, check_strict, check_tensors, cut, slot_layout, steps
from sglang.srt.ray.rdt.trainer.client import WeightSyncClient, WeightSyncRankError
from sglang.srt.ray.rdt.trainer.sender import BucketInFlightError, BucketSender, BucketSenderError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROMPT = "the quick brown fox"


def named(*specs):
    """``[(name, tensor)]`` of float32 tensors of the given numbers of elements."""
    return [(n, torch.full((k,), float(i))) for i, (n, k) in enumerate(specs)]


# --------------------------------------------------------------------------- #
# Pure planning
# --------------------------------------------------------------------------- #
def test_client_names_are_exported_lazily_from_the_package():
    import sglang.srt.ray.rdt as rdt

    assert rdt.WeightSyncClient is WeightSyncClient
    assert issubclass(rdt.WeightSyncRankError, WeightSyncError) and rdt.WeightSyncRankError is WeightSyncRankError
    with pytest.raises(AttributeError):
        rdt.NoSuchThing


def test_client_bucket_size_defaults_follow_the_device():
    from sglang.srt.ray.rdt.defaults import bucket_bytes_for

    assert bucket_bytes_for("cuda") == bucket_bytes_for("cuda:1") == 1 << 30
    assert bucket_bytes_for("cpu") == 256 << 20


def test_cut_keeps_order_fits_the_size_and_gives_a_large_tensor_its_own_group():
    items = named(("a", 100), ("b", 100), ("c", 100), ("huge", 1000), ("d", 10))
    groups = list(cut(iter(items), group_bytes=850))
    assert [g.names for g in groups] == [["a", "b"], ["c"], ["huge"], ["d"]]
    assert [g.index for g in groups] == [0, 1, 2, 3]
    assert [g.nbytes for g in groups] == [800, 400, 4000, 40]
    assert groups[2].specs() == [((1000,), torch.float32)]
    assert groups[0].tensors[1] is items[1][1]  # no copies: the caller's own tensors
    with pytest.raises(WeightSyncError, match="empty update"):
        list(cut(iter([]), 100))
    with pytest.raises(WeightSyncError, match=r"'x' is a list, not a torch.Tensor"):
        list(cut(iter([("x", [1.0, 2.0])]), 100))


@pytest.mark.parametrize("seed", range(4))
def test_a_mapping_is_cut_into_the_same_groups_as_the_same_pairs_one_by_one(seed):
    """A mapping (cut at once from its sizes) and its pairs (cut as they
    come) give the same groups: empty tensors, exact fits and tensors larger
    than a group included."""
    rng = np.random.default_rng(seed)
    numels = rng.choice([0, 1, 25, 50, 200, 260], size=300)
    items = [(f"w{i}", torch.zeros(int(n))) for i, n in enumerate(numels)]
    for group_bytes in (100, 200, 850, 1 << 20):
        by_pairs = list(cut(iter(items), group_bytes))
        at_once = list(cut(dict(items), group_bytes))
        assert [g.names for g in at_once] == [g.names for g in by_pairs]
        assert [(g.index, g.nbytes) for g in at_once] == [(g.index, g.nbytes) for g in by_pairs]
        assert [g.scan.nbytes.tolist() for g in at_once] == [g.scan.nbytes.tolist() for g in by_pairs]
    assert len(by_pairs) == 1 and len(list(cut(dict(items), 100))) > 150


def test_cut_hands_out_a_group_as_soon_as_it_is_complete():
    made = []

    def gen():
        for i in range(6):
            made.append(i)
            yield f"w{i}", torch.zeros(25)  # 100 bytes each

    groups = cut(gen(), group_bytes=200)
    first = next(groups)
    assert first.names == ["w0", "w1"] and made == [0, 1, 2]  # w2 showed w1's group was full
    assert next(groups).names == ["w2", "w3"] and made == [0, 1, 2, 3, 4]


def test_rank_groups_share_a_step_and_sit_side_by_side_in_a_slot():
    w0 = {"x": torch.zeros(64), "y": torch.zeros(64)}
    w1 = {"x": torch.zeros(32), "y": torch.zeros(32)}
    payloads, rank_groups = buckets.split_payloads({0: w0, 1: w1, 2: w0}, 3)
    assert rank_groups == [[0, 2], [1]] and payloads[0] is w0
    all_steps = list(steps(payloads, rank_groups, group_bytes=600))  # 300 B per rank group
    assert [[(rg, g.names) for rg, g in s] for s in all_steps] == [
        [(0, ["x"]), (1, ["x", "y"])], [(0, ["y"])]]
    offsets, need = slot_layout(all_steps[0])
    assert offsets == [[0], [256, 512]] and need == 768
    assert all(o % ALIGN == 0 for region in offsets for o in region)
    with pytest.raises(WeightSyncError, match=r"per-rank update needs tensors for ranks 0..2: missing \[2\]"):
        buckets.split_payloads({0: w0, 1: w1}, 3)


def test_slots_for_any_order_hold_every_step_of_every_order():
    """register()'s slots (no tensors given) hold any step an update of the
    ranks' parameters makes, in any order of its tensors."""
    sizes = [4096, 100, 4096, 100, 9000, 100, 4096, 100]
    rng = random.Random(5)
    for group_bytes in (5000, 8192, 1 << 20):
        for layouts in ([sizes], [sizes, sizes[:4]]):
            slot = buckets.slot_bytes_for(layouts, group_bytes)
            assert slot <= sum(buckets.align_up(n) for ns in layouts for n in ns)
            for _ in range(50):
                orders = [rng.sample(ns, len(ns)) for ns in layouts]
                payloads = [{f"t{i}": torch.empty(n, dtype=torch.uint8) for i, n in enumerate(o)}
                            for o in orders]
                for step in steps(payloads, [[0], [1]][:len(layouts)], group_bytes):
                    assert slot_layout(step)[1] <= slot


def test_layout_check_names_the_parameter_expected_and_actual():
    layout = {"w": {"shape": [4, 4], "dtype": "bfloat16"}, "b": {"shape": [4], "dtype": "bfloat16"}}
    check_tensors(["w"], [(4, 4)], [torch.bfloat16], layout, "rank 0")
    check_tensors(["w", "b"], [[4, 4], [4]], [torch.bfloat16] * 2, layout, "rank 0")  # (lists too)
    check_tensors(["w"], [(4, 4)], [torch.bfloat16], {"w": {"shape": (4, 4), "dtype": "torch.bfloat16"}}, "r")
    with pytest.raises(WeightSyncError, match=r"'w' on rank 1.*dtype=float32.*dtype=bfloat16.*torch\.bfloat16"):
        check_tensors(["w"], [(4, 4)], [torch.float32], layout, "rank 1")
    with pytest.raises(WeightSyncError, match=r"shape=\[2, 4\].*shape=\[4, 4\].*own shard"):
        check_tensors(["w"], [(2, 4)], [torch.bfloat16], layout, "rank 1")
    with pytest.raises(WeightSyncError, match=r"no parameter 'ww'.*did you mean 'w'"):
        check_tensors(["ww"], [(4, 4)], [torch.bfloat16], layout, "rank 0")
    with pytest.raises(WeightSyncError, match=r"no parameter 'ww'.*rollout model's parameter names"):
        check_tensors(["ww"], [(4, 4)], [torch.bfloat16], layout, "rank 0")
    with pytest.raises(WeightSyncError, match=r"no parameter 'rl:w'.*Register the LoRA adapter first"):
        check_tensors(["rl:w"], [(4, 4)], [torch.bfloat16], layout, "rank 0")
    with pytest.raises(WeightSyncError, match=r"strict update: 1 parameters.*\['b'\]"):
        check_strict(["w"], layout, "rank 0")


def test_the_layout_book_checks_a_layout_once_even_when_the_tensors_are_new(monkeypatch):
    """A group with the names, shapes and dtypes of the last one that passed
    is not checked again — also when its tensors are new (a trainer handing
    over fresh tensors every step); a new shape or dtype is, and a refused one
    does not replace the layout that passed."""
    calls = []
    real = buckets.check_tensors
    monkeypatch.setattr(buckets, "check_tensors",
                        lambda *a: calls.append(a[-1]) or real(*a))
    layouts = [{"w": {"shape": [4, 4], "dtype": "float32"}, "b": {"shape": [4], "dtype": "float32"}}]
    book = LayoutBook()

    def assign(tensors, layouts=layouts):
        (group,) = cut(iter(tensors.items()), 1 << 20)
        return book.assign(0, group, [0], layouts, ["rank 0"])

    first = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    lid = assign(first)
    assert calls == ["rank 0"]
    assert assign(first) == lid and len(calls) == 1
    assert assign({"w": torch.ones(4, 4), "b": torch.ones(4)}) == lid and len(calls) == 1
    with pytest.raises(WeightSyncError, match=r"'w' on rank 0.*float64"):
        assign({"w": torch.ones(4, 4, dtype=torch.float64), "b": torch.ones(4)})
    with pytest.raises(WeightSyncError, match=r"'w' on rank 0.*shape=\[2, 8\]"):
        assign({"w": torch.ones(2, 8), "b": torch.ones(4)})
    assert len(calls) == 3
    assert assign(first) == lid and len(calls) == 3
    # New rank layouts (the client refreshed them): checked again.
    assert assign(first, layouts=[dict(layouts[0])]) != lid and len(calls) == 4


# --------------------------------------------------------------------------- #
# The sender's guard (in process, no NIXL registration)
# --------------------------------------------------------------------------- #
def slot_bytes(sender, slot, n):
    return sender._slots[slot][:n].view(torch.float32)


def _groups(*tensors):
    """One group (``buckets.Group``, looked at) per tensor."""
    return [buckets.whole({"t": t}) for t in tensors]


def test_sender_refuses_to_overwrite_a_slot_until_released():
    sender = BucketSender("cpu", register=False)
    assert sender.prepare(4096) == {"slot_bytes": 4096, "slots": 2}
    a, b = torch.arange(8, dtype=torch.float32), torch.full((8,), 7.0)
    assert sender.fill(0, "u1/s0", [[0]], _groups(a), None, False) == [(None, None)]
    assert torch.equal(slot_bytes(sender, 0, 32), a)

    with pytest.raises(BucketInFlightError, match="still being read"):
        sender.fill(0, "u1/s2", [[0]], _groups(b), None, False)
    assert torch.equal(slot_bytes(sender, 0, 32), a)  # nothing was written
    with pytest.raises(BucketSenderError, match="held by 'u1/s0'"):
        sender.release(0, "u1/s2")  # a stale token frees nothing
    with pytest.raises(BucketInFlightError, match="cannot grow"):
        sender.prepare(1 << 20)  # no re-allocation under a reader either

    sender.fill(1, "u1/s1", [[0]], _groups(b), None, False)  # the other slot is free
    sender.release(0, "u1/s0")
    sender.fill(0, "u1/s2", [[0]], _groups(b), None, False)
    assert torch.equal(slot_bytes(sender, 0, 32), b)
    assert sender.in_flight() == ["u1/s2", "u1/s1"]
    with pytest.raises(BucketSenderError, match="does not fit the slot"):
        sender.release(1, "u1/s1") or sender.fill(1, "u1/s3", [[4090]], _groups(b), None, False)


def test_a_fill_that_fails_frees_its_slot_for_the_next_one(monkeypatch):
    """No rank was told of a slot whose fill failed: the next fill may take it (it is not left in flight)."""
    sender = BucketSender("cpu", register=False)
    sender.prepare(4096)
    a = torch.arange(8, dtype=torch.float32)

    def broken(device, dst, group):
        raise RuntimeError("the gather failed")

    monkeypatch.setattr(sender_module, "gather", broken)
    with pytest.raises(RuntimeError, match="the gather failed"):
        sender.fill(0, "u1/s0", [[0]], _groups(a), None, False)
    assert sender.in_flight() == [None, None]
    monkeypatch.undo()
    sender.fill(0, "u2/s0", [[0]], _groups(a), None, False)
    assert sender.in_flight() == ["u2/s0", None] and torch.equal(slot_bytes(sender, 0, 32), a)


def test_sender_keeps_its_slots_and_grows_only_when_asked_for_more():
    sender = BucketSender("cpu", register=False)
    sender.prepare(4096)
    first = sender._slots[0].data_ptr()
    sender.prepare(1024)
    assert sender.slot_bytes == 4096 and sender._slots[0].data_ptr() == first
    assert sender.stats["allocations"] == 2
    sender.prepare(8192)
    assert sender.slot_bytes == 8192 and sender.stats["allocations"] == 4
    assert sender.close() == 2
    with pytest.raises(BucketSenderError, match="closed"):
        sender.fill(0, "t", [[0]], _groups(torch.zeros(2)), None, False)


# --------------------------------------------------------------------------- #
# Metrics (fake backend)
# --------------------------------------------------------------------------- #
class FakeMetric:
    registry = {}

    def __init__(self, name, documentation="", labelnames=None, buckets=None):
        self.name, self.labelnames, self.values, self.tags = name, list(labelnames or []), [], {}
        FakeMetric.registry[name] = self

    def labels(self, **kw):
        assert sorted(kw) == sorted(self.labelnames), (kw, self.labelnames)
        clone = FakeMetric.__new__(FakeMetric)
        clone.__dict__.update(self.__dict__, tags=kw)
        return clone

    def inc(self, v=1.0):
        self.values.append((self.tags, v))

    observe = inc


def test_metrics_are_off_until_configured_and_count_pulls_updates_failures():
    from sglang.srt.ray.rdt.engine import metrics

    metrics.configure(False)
    metrics.record_pull({"bytes": 1, "tensors": 1, "seconds": 0.1})  # no-op, no error
    assert not metrics.enabled()
    FakeMetric.registry.clear()
    metrics.configure(True, {"dp_rank": 1, "tp_rank": 0}, counter=FakeMetric, histogram=FakeMetric)
    try:
        metrics.record_pull({"bytes": 4096, "tensors": 3, "seconds": 0.02})
        metrics.record_update(1.5)
        metrics.record_failure("transfer")
        metrics.record_failure("weird")
        reg = FakeMetric.registry
        tags = {"dp_rank": "1", "tp_rank": "0"}
        assert reg["sglang:rdt_weight_pull_bytes"].values == [(tags, 4096.0)]
        assert reg["sglang:rdt_weight_pull_tensors"].values == [(tags, 3.0)]
        assert reg["sglang:rdt_weight_pull_seconds"].values == [(tags, 0.02)]
        assert reg["sglang:rdt_weight_updates"].values == [(tags, 1)]
        assert reg["sglang:rdt_weight_update_seconds"].values == [(tags, 1.5)]
        assert [t["kind"] for t, _ in reg["sglang:rdt_weight_sync_failures"].values] == [
            "transfer", "other"]
    finally:
        metrics.configure(False)


# --------------------------------------------------------------------------- #
# Toy ranks: real Ray, real NIXL, the product's standalone rank, no server
# --------------------------------------------------------------------------- #
def actor_options():
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {"runtime_env": {"env_vars": {"PYTHONPATH": path}}}


@pytest.fixture(scope="module")
def toy(ray_client):
    from client_actors import FakeRank

    ray = ray_client
    # Started together (each imports sglang: tens of seconds on a small box).
    ranks = [FakeRank.options(**actor_options()).remote(i) for i in range(4)]
    ray.get([r.register_weight_for_rdt.remote() for r in ranks], timeout=300)
    yield SimpleNamespace(ray=ray, ranks=ranks[:2], victim=ranks[2], lane_victim=ranks[3],
                          names=["fake-0", "fake-1"])
    for a in ranks:
        ray.kill(a)


@pytest.fixture
def calm(toy):
    """Both ranks fast and willing before the test."""
    toy.ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    return toy


def new_weights(seed):
    from client_actors import deep_model

    return {n: p.detach().clone() for n, p in deep_model(seed).named_parameters()}


GROUP_BYTES = 5000  # one 32x32 weight + its bias


def toy_client(toy, **kw):
    kw.setdefault("bucket_bytes", GROUP_BYTES)
    return WeightSyncClient(toy.ranks, names=toy.names, **kw)


def logs(toy, ranks=None):
    return [toy.ray.get(r.log.remote(), timeout=60) for r in ranks or toy.ranks]


def states(toy, ranks=None):
    return [toy.ray.get(r.state.remote(), timeout=60) for r in ranks or toy.ranks]


def assert_ranks_hold(toy, weights, ranks=None):
    for state in states(toy, ranks):
        assert sorted(state) == sorted(weights)
        for n, t in weights.items():
            assert torch.equal(state[n], t), n


def test_buckets_never_change_a_slot_while_a_slow_rank_reads_it(calm):
    """Buckets with a slow rank: a slot is refilled only once every rank's
    pull of it returned — the slow rank reads each slot only after a delay,
    so an early refill would land another step's bytes in its parameters."""
    toy = calm
    toy.ray.get(toy.ranks[1].configure.remote(delay_s=0.3))
    before = logs(toy)
    weights = new_weights(seed=11)
    seen = []
    with toy_client(toy, export="buckets") as client:
        stats = client.update(weights, version="db-1",
                              progress=lambda b, done, total: seen.append((done, total)))
        assert client.sender.sender.in_flight() == [None, None]
        assert client.sender.sender.stats["fills"] == len(stats.buckets)
        assert client.sender.sender.stats["registrations"] == 0  # read over lanes: never registered with NIXL
    assert_ranks_hold(toy, weights)
    n = len(stats.buckets)
    assert n == 6 and seen == [(i + 1, n) for i in range(n)]
    assert (stats.path, stats.transport, stats.tensors, stats.ranks) == ("buckets", "cma", len(weights), 2)
    assert stats.bytes == sum(t.nbytes for t in weights.values()) and stats.bytes_moved == 2 * stats.bytes
    assert stats.lane_calls == 2 * n and stats.held_bytes == 0  # copied: nothing of the caller's held
    after = logs(toy)
    for b, a in zip(before, after):
        assert a["pulls"] - b["pulls"] == n and a["version"] == "db-1"
        assert a["updates"] == b["updates"] + 1
    # The slow rank's pulls started one delay apart at least: they were
    # serialized behind the sleep, and still every byte is the right one.
    slow = after[1]["starts"][len(before[1]["starts"]):][:n]  # (the update's end asks too)
    assert len(slow) == n and all(t1 - t0 >= 0.29 for t0, t1 in zip(slow, slow[1:]))


@pytest.mark.parametrize("transport,path", [("SGLANG_IPC", "cma"), ("nixl", "nixl")])
def test_without_lanes_ranks_pull_refs_of_the_slots_through_ray(calm, transport, path):
    toy = calm
    weights = new_weights(seed=31 if transport == "nixl" else 32)
    with toy_client(toy, lane=False, transport=transport) as client:
        route = client.route()
        assert (route.direct, route.lanes, route.ref_transport) == (False, set(), transport)
        stats = client.update(weights, version=f"ray-{transport}")
        assert client.sender.sender.stats["puts"] == len(stats.buckets)
        assert client.sender.sender.stats["registrations"] == 2 < len(stats.buckets)  # each slot, once
    assert_ranks_hold(toy, weights)
    assert (stats.transport, stats.lane_calls) == (path, 0)
    assert [log["version"] for log in logs(toy)] == [f"ray-{transport}"] * 2
    with pytest.raises(ValueError, match="sender must be 'local'"):
        WeightSyncClient(toy.ranks, sender="remote")
    with pytest.raises(ValueError, match="transport must be 'auto', 'nixl' or 'SGLANG_IPC'"):
        WeightSyncClient(toy.ranks, transport="tcp")


def test_direct_reads_the_callers_tensors_in_place_and_holds_nothing_after(calm):
    """export="direct" on the CPU: the ranks read this process's own tensors
    over their lanes (no slot memory at all); fresh tensors every update land
    as well as the same ones refilled."""
    toy = calm
    with toy_client(toy, export="direct") as client:
        route = client.route()
        assert (route.direct, route.lanes, route.why_not_direct) == (True, {0, 1}, None)
        weights = new_weights(seed=41)
        first = client.update(weights, version="direct-1")
        assert_ranks_hold(toy, weights)
        for t in weights.values():
            t.add_(1.0)  # refilled in place
        second = client.update(weights, version="direct-2")
        assert_ranks_hold(toy, weights)
        fresh = new_weights(seed=42)  # new tensors, new addresses
        third = client.update(fresh, version="direct-3")
        assert_ranks_hold(toy, fresh)
        assert client.sender.sender is None  # no slot memory was ever allocated
    model_bytes = sum(t.nbytes for t in fresh.values())
    for stats in (first, second, third):
        assert (stats.path, stats.transport, stats.tensors, stats.bytes) == (
            "direct", "cma", len(fresh), model_bytes)
        assert stats.lane_calls == 2 * len(stats.buckets)
        assert 0 < stats.held_bytes <= model_bytes
        assert stats.gathered_bytes == 0  # host memory: read where it is
    for log in logs(toy):
        assert log["version"] == "direct-3"
    st = toy.ray.get(toy.ranks[0].get_weight_sync_status.remote())
    assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (True, False, "direct-3")


def test_one_rank_over_its_lane_is_pulled_then_finalized_and_a_failed_pull_aborts(calm):
    """One rank reached over its lane, in an update the caller paused for:
    one pull, then the update's end (a request of its own); a pull that
    fails ends nothing and the update is aborted."""
    toy = calm
    one = toy.ranks[:1]
    with WeightSyncClient(one, names=toy.names[:1], export="direct") as client:
        client.update(new_weights(seed=61), version="one-1")
        before = logs(toy, one)[0]
        weights = new_weights(seed=62)
        stats = client.update(weights, version="one-2")
        after = logs(toy, one)[0]
        assert (stats.lane_calls, len(stats.buckets)) == (1, 1) and stats.end_seconds > 0
        assert after["lane_calls"] - before["lane_calls"] == 2  # the pull, then the finalize
        assert (after["version"], after["updates"], after["pulls"]) == (
            "one-2", before["updates"] + 1, before["pulls"] + 1)
        toy.ray.get(one[0].configure.remote(fail="disk on fire"))
        with pytest.raises(WeightSyncRankError, match="disk on fire") as err:
            client.update(new_weights(seed=63), version="never")
        assert err.value.aborted is True
        failed = logs(toy, one)[0]
        assert (failed["version"], failed["updates"]) == ("one-2", after["updates"])
        st = toy.ray.get(one[0].get_weight_sync_status.remote())
        assert (st["update_open"], st["weight_version"]) == (False, "one-2")
    assert_ranks_hold(toy, weights, one)


@pytest.mark.parametrize("export", ["direct", "buckets"])
def test_a_streamed_update_lands_every_byte_and_keeps_two_groups_alive(calm, export):
    """An iterator's tensors are made as the update consumes it: at most two
    buckets' worth of them are alive at once, whatever the model's size (in
    place: groups of half a bucket, up to three in flight and one being made;
    slots: two groups of a bucket)."""
    toy = calm
    weights = new_weights(seed=51 if export == "direct" else 52)
    sizes = [t.nbytes for t in weights.values()]
    alive, peak = set(), []

    def stream():
        for n, t in weights.items():
            fresh = t.clone()  # a new tensor every time, as a gather loop makes
            key = id(fresh)
            alive.add(key)
            weakref.finalize(fresh, alive.discard, key)
            peak.append(sum(1 for _ in alive))
            yield n, fresh
            del fresh

    with toy_client(toy, export=export) as client:
        stats = client.update(stream(), version=f"stream-{export}", strict=True)
    assert_ranks_hold(toy, weights)
    assert not alive  # nothing of the caller's is kept after update() returns
    assert stats.tensors == len(weights) and stats.bytes == sum(sizes)
    # slots: groups of a weight and its bias; in place: one tensor each (a weight is over half a bucket)
    assert len(stats.buckets) == (12 if export == "direct" else 6)
    assert max(peak) <= 2 * 2 + 1  # two buckets' worth (two weights and biases), and the new one
    if export == "direct":
        assert 0 < stats.held_bytes <= 2 * GROUP_BYTES
    else:
        assert stats.held_bytes == 0
    assert [log["version"] for log in logs(toy)] == [f"stream-{export}"] * 2


def test_a_strict_stream_that_misses_a_parameter_is_aborted_at_its_end(calm):
    toy = calm
    weights = new_weights(seed=53)
    good = new_weights(seed=54)
    with toy_client(toy, export="direct") as client:
        client.update(good, version="good")
        with pytest.raises(WeightSyncError, match=r"strict update: 1 parameters of rank 0 \(fake-0\)"):
            client.update(iter(list(weights.items())[:-1]), version="partial", strict=True)
        st = toy.ray.get(toy.ranks[0].get_weight_sync_status.remote())
        assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (False, False, "good")
        client.update(good, version="good-again")
    st = toy.ray.get(toy.ranks[0].get_weight_sync_status.remote())
    assert (st["weights_consistent"], st["weight_version"]) == (True, "good-again")


def test_register_with_the_tensors_prepares_the_first_update_and_writes_nothing(calm):
    toy = calm
    before_state, before = states(toy), logs(toy)
    weights = new_weights(seed=44)
    with toy_client(toy, export="direct", bucket_bytes=1 << 20) as client:  # (a few groups in place)
        with pytest.raises(WeightSyncError, match=r"no parameter '0.wieght'"):
            client.register({"0.wieght": weights["0.weight"]})  # checked before anything moves
        client.register(weights)
        for state, now in zip(before_state, states(toy)):  # nothing was written
            assert all(torch.equal(now[n], state[n]) for n in state)
        mid = logs(toy)
        assert [(m["pulls"], m["updates"]) for m in mid] == [(b["pulls"], b["updates"]) for b in before]
        assert all(m["lane_calls"] > b["lane_calls"] for m, b in zip(mid, before))  # the prepares
        prepared = [set(client.lanes.links[r].defined) for r in (0, 1)]
        assert all(prepared)
        stats = client.update(weights, version="prepared")
        # The update was grouped as register() grouped it: no layout was new to a rank.
        assert [client.lanes.links[r].defined for r in (0, 1)] == prepared
        assert len(stats.buckets) == len(prepared[0])
    assert_ranks_hold(toy, weights)
    for r in toy.ranks:
        last = toy.ray.get(r.get_weight_sync_status.remote())["last_pull"]
        assert last["plan_reused"] is True


def test_register_without_tensors_makes_the_slots_a_stream_fills(calm):
    """A trainer that streams registers without tensors: the bucket slots its
    updates fill are made (and NIXL-registered) by register(), not by its
    first update; a bucket each, or what every rank's parameters need when
    that is less."""
    toy = calm
    weights = new_weights(seed=45)
    model = sum(buckets.align_up(t.nbytes) for t in weights.values())  # (both ranks hold the same)
    # a bucket plus every tensor's alignment (in whatever order they come), or the model if less
    for bucket_bytes, slot in ((GROUP_BYTES, GROUP_BYTES + ALIGN * len(weights)), (1 << 20, model)):
        with toy_client(toy, export="buckets", bucket_bytes=bucket_bytes) as client:
            client.register()
            sender = client.sender.sender
            assert (sender.slot_bytes, sender.stats["allocations"]) == (slot, 2)
            stats = client.update(iter(list(weights.items())), version=f"slots-{bucket_bytes}")
            assert stats.path == "buckets" and sender.stats["allocations"] == 2  # no slot made anew
        assert_ranks_hold(toy, weights)


def test_register_reserves_no_slots_on_a_direct_route_and_a_gathering_stream_makes_them_once(calm):
    """Ranks that read in place: register() without tensors reserves no slot
    memory (a trainer whose tensors are read where they are never needs it).
    The first stream that must be gathered (transposed views) makes the two
    slots once, large enough for any step of the ranks' parameters, and every
    byte lands."""
    toy = calm
    weights = new_weights(seed=46)

    def transposed():  # the same values, laid out column-major: not readable in place
        for n, t in weights.items():
            yield n, (t.t().contiguous().t() if t.dim() == 2 else t.clone())

    with toy_client(toy, export="direct") as client:
        client.register()
        assert client.sender.sender is None and client.pool_bytes() == 0
        stats = client.update(transposed(), version="transposed")
        sender = client.sender.sender
        assert stats.path in ("buckets", "direct+buckets") and stats.gathered_bytes >= sum(
            t.nbytes for t in weights.values() if t.dim() == 2)
        assert sender.stats["allocations"] == 2  # made once: no step outgrew them
        assert sender.slot_bytes == client.slot_bytes_for_any_update(GROUP_BYTES) > GROUP_BYTES
        again = client.update(transposed(), version="transposed-2")
        assert again.gathered_bytes == stats.gathered_bytes and sender.stats["allocations"] == 2
    assert_ranks_hold(toy, weights)


def test_a_rank_that_cannot_read_this_process_gets_its_pulls_through_ray(calm, caplog):
    """A rank on this node that the kernel will not let read this process
    (here: ``SGLANG_RDT_CMA=0`` on the rank, as in a container without ptrace
    rights) gets no lane; its pulls come as refs through Ray (NIXL), the
    other rank's over its lane, and every byte lands."""
    from client_actors import FakeRank

    toy = calm
    opts = actor_options()
    opts["runtime_env"]["env_vars"]["SGLANG_RDT_CMA"] = "0"
    walled = FakeRank.options(**opts).remote(7)
    try:
        toy.ray.get(walled.register_weight_for_rdt.remote(), timeout=300)
        weights = new_weights(seed=61)
        with WeightSyncClient([toy.ranks[0], walled], names=["fake-0", "walled"],
                              bucket_bytes=GROUP_BYTES) as client:
            with caplog.at_level("WARNING", logger="sglang.srt.ray.rdt.trainer.lane"):
                route = client.route()
            assert (route.lanes, route.ref_transport) == ({0}, "SGLANG_IPC")
            assert route.why_not_direct == "rank 1 (walled) cannot be reached over a same-node lane"
            assert any("rank 1 (walled) cannot read this process's memory (SGLANG_RDT_CMA=0)"
                       in r.getMessage() for r in caplog.records)
            stats = client.update(weights, version="walled-1")
        assert sorted(stats.transport.split(",")) == ["cma", "nixl (SGLANG_RDT_CMA=0)"]  # the reason shows
        assert stats.lane_calls == len(stats.buckets)  # rank 0's only
        assert_ranks_hold(toy, weights, [toy.ranks[0], walled])
    finally:
        toy.ray.kill(walled)


def test_failing_rank_surfaces_as_one_error_naming_the_rank_and_aborts(calm):
    toy = calm
    toy.ray.get(toy.ranks[1].configure.remote(fail="disk on fire"))
    before = logs(toy)
    with toy_client(toy, export="buckets") as client:
        with pytest.raises(WeightSyncRankError) as err:
            client.update(new_weights(seed=12), version="never")
        e = err.value
        assert (e.rank, e.actor_name, e.aborted) == (1, "fake-1", True)
        assert [r for r, _ in e.failures] == [1]
        assert re.search(r"^rank 1 \(fake-1\) failed during pull of step 1: .*disk on fire", str(e)), str(e)
        assert client.sender.sender.in_flight() == [None, None]
        after = logs(toy)
        # Aborted on every rank, never finalized; rank 0 pulled, so it says so.
        assert [a["version"] for a in after] == [b["version"] for b in before]
        assert [a["updates"] for a in after] == [b["updates"] for b in before]
        st = [toy.ray.get(r.get_weight_sync_status.remote()) for r in toy.ranks]
        assert [s["update_open"] for s in st] == [False, False]
        assert st[0]["weights_consistent"] is False
        # Fixed, the same client updates again and the ranks are whole.
        toy.ray.get(toy.ranks[1].configure.remote(fail=None))
        weights = new_weights(seed=13)
        client.update(weights, version="fixed")
    assert_ranks_hold(toy, weights)
    st = [toy.ray.get(r.get_weight_sync_status.remote()) for r in toy.ranks]
    assert [(s["weights_consistent"], s["weight_version"]) for s in st] == [(True, "fixed")] * 2


def test_dead_rank_is_named_in_the_error(calm):
    toy = calm
    client = WeightSyncClient([toy.ranks[0], toy.victim], names=["fake-0", "victim"],
                              bucket_bytes=GROUP_BYTES)
    client.parameter_layouts()  # found alive ...
    toy.ray.kill(toy.victim)  # ... and gone before the update

    def dead():
        try:
            toy.ray.get(toy.victim.log.remote(), timeout=30)
        except toy.ray.exceptions.RayActorError:
            return True
        return False

    wait_until(dead, 60, what="the victim's death")
    with pytest.raises(WeightSyncRankError, match=r"^rank 1 \(victim\) failed during \w+.*died") as err:
        client.update(new_weights(seed=14), version="never")
    assert err.value.rank == 1
    client.close()


def test_a_rank_that_dies_during_a_lane_call_is_named_at_once(calm):
    """A lane call cannot hang on a dead rank: the client sees the rank's
    process exit within its liveness check, long before the pull's timeout."""
    toy = calm
    victim = toy.lane_victim
    weights = new_weights(seed=46)
    client = WeightSyncClient([toy.ranks[0], victim], names=["fake-0", "lane-victim"], export="direct")
    client.update(weights, version="before")
    calls = toy.ray.get(victim.log.remote())["lane_calls"]
    toy.ray.get(victim.configure.remote(delay_s=120.0))  # its next pull sleeps before reading

    def kill_once_the_lane_call_arrived():
        while toy.ray.get(victim.log.remote())["lane_calls"] == calls:
            time.sleep(0.02)
        toy.ray.kill(victim)

    killer = threading.Thread(target=kill_once_the_lane_call_arrived)
    killer.start()
    with pytest.raises(WeightSyncRankError, match=r"^rank 1 \(lane-victim\) failed during pull of step 1: "
                       r"RankGone: .*\(pid \d+\) exited") as err:
        client.update(weights, version="never")
    killer.join()
    assert [r for r, _ in err.value.failures] == [1]
    client.lanes.close()


def test_tensors_that_do_not_fit_are_rejected_before_any_byte_moves(calm):
    toy = calm
    before_state, before = states(toy), logs(toy)
    weights = new_weights(seed=15)
    with toy_client(toy) as client:
        bad_dtype = {**weights, "0.weight": weights["0.weight"].double()}
        with pytest.raises(WeightSyncError, match=r"'0.weight' on rank 0 \(fake-0\).*float64.*float32"):
            client.update(bad_dtype)
        with pytest.raises(WeightSyncError, match=r"no parameter '0.wieght'.*did you mean '0.weight'"):
            client.update({"0.wieght": weights["0.weight"]})
        with pytest.raises(WeightSyncError, match=r"strict update"):
            client.update({"0.weight": weights["0.weight"]}, strict=True)
        with pytest.raises(WeightSyncError, match=r"per-rank update needs tensors for ranks 0..1: missing \[1\]"):
            client.update({0: weights})
        assert client.sender.sender is None  # nothing was even copied
    after = logs(toy)
    assert [(a["pulls"], a["updates"], a["failures"]) for a in after] == [
        (b["pulls"], b["updates"], b["failures"]) for b in before]
    for state, now in zip(before_state, states(toy)):
        assert all(torch.equal(now[n], state[n]) for n in state)


def test_a_layout_that_passed_is_checked_again_once_it_changes(calm):
    toy = calm
    with toy_client(toy) as client:
        client.update(new_weights(seed=16), version="a")
        weights2 = new_weights(seed=17)
        client.update(weights2, version="b")  # same layout: the cached check
        assert_ranks_hold(toy, weights2)
        bad = {**weights2, "0.weight": weights2["0.weight"].double()}
        with pytest.raises(WeightSyncError, match=r"'0.weight' on rank 0 \(fake-0\).*float64"):
            client.update(bad)
    assert_ranks_hold(toy, weights2)


class FakeEngine:
    """The session half of a RayEngine: what WeightSyncClient.from_engine calls."""

    def __init__(self, actors):
        self.actors, self.calls = actors, []

    def get_scheduler_actors(self):
        return self.actors

    def begin_weight_sync(self, lease_s=300.0):
        self.calls.append(("begin", time.time(), lease_s))
        return {"session_id": "s1", "lease_s": lease_s}

    def end_weight_sync(self, weight_version=None, flush_cache=True):
        self.calls.append(("end", time.time(), weight_version))
        return {"success": True}

    def abort_weight_sync(self, reason="aborted"):
        self.calls.append(("abort", time.time(), reason))


def test_engine_session_opens_after_validation_and_closes_after_every_pull(calm):
    toy = calm
    engine = FakeEngine(toy.ranks)
    client = WeightSyncClient.from_engine(engine, bucket_bytes=GROUP_BYTES, lease_s=42)
    with pytest.raises(WeightSyncError, match="no parameter"):
        client.update({"nope": torch.zeros(1)})
    assert engine.calls == []  # rejected before the session: serving never paused

    before = logs(toy)
    weights = new_weights(seed=18)
    client.update(weights, version="e-1")
    (begin, t_begin, lease), (end, t_end, version) = engine.calls
    assert (begin, lease, end, version) == ("begin", 42, "end", "e-1")
    starts = [t for b, a in zip(before, logs(toy)) for t in a["starts"][len(b["starts"]):]]
    assert starts and all(t_begin < t < t_end for t in starts)
    assert_ranks_hold(toy, weights)

    toy.ray.get(toy.ranks[0].configure.remote(fail="boom"))
    with pytest.raises(WeightSyncRankError, match=r"^rank 0 failed during pull of step 1"):
        client.update(new_weights(seed=19), version="e-2")
    assert [c[0] for c in engine.calls] == ["begin", "end", "begin", "abort"]
    assert "boom" in engine.calls[-1][2]
    client.close()
    # The fake engine did not abort the ranks' own updates: close them here.
    toy.ray.get([r.configure.remote(fail=None) for r in toy.ranks])
    toy.ray.get([r.abort_weight_update.remote("test cleanup") for r in toy.ranks])


def test_per_rank_tensors_land_on_their_own_rank(calm):
    toy = calm
    w0, w1 = new_weights(seed=16), new_weights(seed=17)
    with toy_client(toy) as client:
        stats = client.update({0: w0, 1: w1}, version="per-rank")
    assert_ranks_hold(toy, w0, [toy.ranks[0]])
    assert_ranks_hold(toy, w1, [toy.ranks[1]])
    model_bytes = sum(t.nbytes for t in w0.values())
    assert stats.bytes == stats.bytes_moved == 2 * model_bytes


# --------------------------------------------------------------------------- #
# Slow: a live CPU server, Ray's metrics endpoint, `make demo`
# --------------------------------------------------------------------------- #
@pytest.mark.slow
def test_client_updates_a_live_server_and_rejects_bad_tensors_first(
    launch_server, tiny_model, ray_head, ray_client
):
    from tiny_model import hf_greedy, random_state_dict

    server = launch_server(
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace,
         "--enable-metrics"]
    )
    old = server.output_ids(PROMPT, 16)
    assert old == hf_greedy(tiny_model, PROMPT, 16)

    client = WeightSyncClient.connect(
        port=server.port, namespace=ray_head.namespace, bucket_bytes=64 * 1024
    )
    assert len(client.ranks) == 1 and f"_port{server.port}_dp0_pp0_tp0_" in client.ranks[0].name
    assert client.register()[0]["registered"] is True
    cfg = client.parallelism_configs()[0]
    assert (cfg["tp_size"], cfg["dp_size"], cfg["device"]) == (1, 1, "cpu")
    ptrs = {n: v["data_ptr"] for n, v in client.parameter_layouts()[0].items()}

    # A bad update fails before the session opens: serving never paused.
    new = random_state_dict(tiny_model, 21)
    with pytest.raises(WeightSyncError, match=r"lm_head.weight.*float64"):
        client.update({**new, "lm_head.weight": new["lm_head.weight"].double()}, version="bad")
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert (status["update_open"], status["failed_updates"], status["updates"]) == (False, 0, 0)
    assert server.output_ids(PROMPT, 16) == old

    for seed, version in ((21, "c-1"), (22, "c-2")):
        new = random_state_dict(tiny_model, seed)
        stats = client.update(new, version=version, strict=True)
        assert len(stats.buckets) >= 3 and stats.tensors == len(ptrs)
        res = server.generate(PROMPT, 16)
        assert res["output_ids"] == hf_greedy(tiny_model, PROMPT, 16, new) != old
        assert res["meta_info"]["weight_version"] == version
    # Zero copy on the engine; the client's two slots were allocated once.
    assert {n: v["data_ptr"] for n, v in client.parameter_layouts(refresh=True)[0].items()} == ptrs
    assert client.sender.sender.stats["allocations"] == 2
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert (status["weights_consistent"], status["weight_version"], status["updates"]) == (
        True, "c-2", 2)

    # A pull outside a session is refused by the rank: one "rejected" failure.
    rank = client.ranks[0].actor
    with pytest.raises(ray_client.exceptions.RayTaskError, match="refusing to pull"):
        ray_client.get(rank.pull_weights.remote([], []), timeout=60)

    # The rank's own per-update figures, its log line and its Prometheus metrics.
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    rs = ray_client.get(rank.get_weight_sync_stats.remote(), timeout=60)
    last = rs["last_update"]
    assert (rs["updates"], rs["failures"], rs["metrics_enabled"]) == (2, {"rejected": 1}, True)
    assert (last["weight_version"], last["tensors"], last["bytes"]) == ("c-2", len(ptrs), model_bytes)
    assert last["pulls"] == len(stats.buckets) and last["transfer_seconds"] > 0
    assert rs["pulls"]["bytes"] == 2 * model_bytes
    lines = [l for l in server.log().splitlines() if "[RDT] weight update dp0/pp0/tp0 done" in l]
    assert len(lines) == 2, server.log()[-3000:]
    assert f"weight_version=c-2 tensors={len(ptrs)} bytes={model_bytes} " in lines[1]
    assert re.search(r"transfer [\d.]+ s \([\d.]+ GB/s\), update [\d.]+ s, transport=\w+", lines[1])

    labels = '{dp_rank="0",pp_rank="0",tp_rank="0"}'
    wanted = {
        f"sglang:rdt_weight_updates_total{labels}": 2.0,
        f"sglang:rdt_weight_pulls_total{labels}": float(rs["pulls"]["pulls"]),
        f"sglang:rdt_weight_pull_bytes_total{labels}": float(2 * model_bytes),
        f"sglang:rdt_weight_pull_tensors_total{labels}": float(2 * len(ptrs)),
        f"sglang:rdt_weight_update_seconds_count{labels}": 2.0,
        'sglang:rdt_weight_sync_failures_total{dp_rank="0",kind="rejected",pp_rank="0",tp_rank="0"}': 1.0,
    }
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    assert {k: samples.get(k) for k in wanted} == wanted, text[-3000:]
    # next to sglang's own scheduler metrics, which the Ray backend now exports too
    assert any(k.startswith("sglang:num_running_reqs") for k in samples), sorted(samples)[:60]
    client.close()

    # The real SchedulerActor reads this process's own tensors in place over
    # its call lane: fresh tensors, then a stream of them.
    with WeightSyncClient.connect(port=server.port, namespace=ray_head.namespace,
                                  export="direct", bucket_bytes=64 * 1024) as direct_client:
        assert direct_client.route().lanes == {0}
        for seed, version, stream in ((23, "d-1", False), (24, "d-2", True)):
            new = random_state_dict(tiny_model, seed)
            stats = direct_client.update(iter(list(new.items())) if stream else new,
                                         version=version, strict=True)
            assert (stats.path, stats.transport, stats.lane_calls) == ("direct", "cma", len(stats.buckets))
            res = server.generate(PROMPT, 16)
            assert res["output_ids"] == hf_greedy(tiny_model, PROMPT, 16, new)
            assert res["meta_info"]["weight_version"] == version
        lane = ray_client.get(rank.get_weight_sync_status.remote(), timeout=60)["lane"]
        assert lane["open"] and lane["calls"] >= 2 * len(stats.buckets)

    # Generation paused by the caller (no session): fresh tensors, then a
    # stream, each ended by the client on the rank; generation continues on them.
    requests.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=60).raise_for_status()
    actors = [r.actor for r in direct_client.ranks]
    with WeightSyncClient(actors, export="direct", bucket_bytes=64 * 1024) as paused_client:
        for seed, version, stream in ((25, "p-1", False), (26, "p-2", True)):
            new = random_state_dict(tiny_model, seed)
            stats = paused_client.update(iter(list(new.items())) if stream else new, version=version,
                                         strict=True)
            assert (stats.path, stats.tensors) == ("direct", len(ptrs))
    requests.post(f"{server.url}/continue_generation", json={}, timeout=60).raise_for_status()
    res = server.generate(PROMPT, 16)
    assert res["output_ids"] == hf_greedy(tiny_model, PROMPT, 16, new)
    assert res["meta_info"]["weight_version"] == "p-2"
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert (status["weights_consistent"], status["update_open"]) == (True, False)


@pytest.mark.slow
def test_metrics_recorded_in_an_actor_reach_rays_prometheus_endpoint(ray_client):
    from client_actors import MetricsProbe

    probe = MetricsProbe.options(**actor_options()).remote()
    assert ray_client.get(probe.record.remote({"dp_rank": 3, "tp_rank": 1}), timeout=300)
    port = ray_client.nodes()[0]["MetricsExportPort"]
    wanted = {
        "ray_sglang_rdt_weight_pull_bytes_total": 4096.0,
        "ray_sglang_rdt_weight_pulls_total": 1.0,
        "ray_sglang_rdt_weight_updates_total": 1.0,
        "ray_sglang_rdt_weight_sync_failures_total": 1.0,
        "ray_sglang_rdt_weight_pull_seconds_count": 1.0,
    }
    deadline, found = time.monotonic() + 90, {}
    while time.monotonic() < deadline and len(found) < len(wanted):
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in wanted and 'dp_rank="3"' in line and 'tp_rank="1"' in line:
                found[name] = float(line.rsplit(" ", 1)[1])
        time.sleep(2)
    ray_client.kill(probe)
    assert found == wanted


def _demo_env():
    # The demo starts its own cluster: nothing of the test session's may leak in.
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


@pytest.mark.slow
def test_make_demo_syncs_three_versions_and_leaves_nothing_running():
    venv = Path(sys.executable).parent.parent
    t0 = time.monotonic()
    # -o: the suite already runs in the installed environment; never reinstall
    # the package under the running tests.
    proc = subprocess.run(
        ["make", "-o", str(venv / ".fork-installed"), f"VENV={venv}", "demo"],
        cwd=REPO, env=_demo_env(), capture_output=True, text=True, timeout=900,
    )
    seconds = time.monotonic() - t0
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-4000:]
    print(f"make demo: {seconds:.0f} s")
    afters = re.findall(r"after\s+weight_version=(\S+) .*\[same as the trainer model\]", out)
    assert afters == ["v1", "v2", "v3"], out
    befores = re.findall(r"before\s+weight_version=(\S+)", out)
    assert befores[1:] == ["v1", "v2"], out
    synced = re.findall(r"synced\s+\d+ tensors, ([\d.]+) MiB in ([\d.]+) s \(([\d.]+) GB/s\)", out)
    assert len(synced) == 3 and all(float(mib) > 0 for mib, _, _ in synced), out
    assert "engine status: weight_version=v3, updates=3, failed=0, weights_consistent=True" in out
    assert "nothing left running" in out and "demo finished" in out
    ray_dir = re.search(r"temp dir (/tmp/\S+)\)", out).group(1)
    port = re.search(r"--port (\d+)", out).group(1)
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"])
        if ray_dir in " ".join(p.info["cmdline"] or [])
        or f"--port {port}" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == [] and not Path(ray_dir).exists()


def test_a_failed_update_returns_only_after_every_rank_stopped_reading_the_callers_tensors(calm):
    """Rank 1's lane breaks as the step is sent, after rank 0 (slow to start
    reading) was sent its pull: update() raises only once rank 0 read; the
    trainer overwrites its tensors the moment it gets the error, and no byte
    of that reaches a rank."""
    toy = calm
    with toy_client(toy, export="direct") as client:  # host memory, read in place
        client.update(new_weights(seed=71), version="before")
        toy.ray.get(toy.ranks[0].configure.remote(delay_s=1.0))
        client.lanes.links[1]._sock.close()  # the lane to rank 1 is gone: its send fails
        weights = new_weights(seed=72)
        with pytest.raises(WeightSyncError):
            client.update(weights, version="broken")
        for t in weights.values():
            t.fill_(666.0)  # the trainer reuses its memory at once
        toy.ray.get(toy.ranks[0].configure.remote(delay_s=0.0))
        state = states(toy, toy.ranks[:1])[0]
    assert all(torch.equal(state[n], t) for n, t in new_weights(seed=72).items())  # read whole, before
    assert not any((v == 666.0).any() for v in state.values())
