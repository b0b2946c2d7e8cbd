"""WeightSyncClient, its bucket sender and planning, the metrics, and ``make demo``.

* pure: bucket planning, layout checks, the sender's in-flight guard, metrics
  with a fake backend (no Ray);
* toy ranks (real Ray head, real NIXL, no server): double buffering with a
  slow rank, a failing rank, a dead rank, rejected tensors, per-rank tensors;
* slow: the client against a live CPU server (CLI), metrics on Ray's
  Prometheus endpoint, and ``make demo``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests
import torch

from sglang.srt.ray.rdt.trainer.buckets import (
    ALIGN,
    TensorItem,
    check_tensors,
    group_ranks,
    plan_buckets,
    plan_steps,
)
from sglang.srt.ray.rdt.trainer.client import WeightSyncClient, WeightSyncRankError
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer.sender import BucketInFlightError, BucketSender, BucketSenderError

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PROMPT = "the quick brown fox"


def item(name, shape, dtype="float32"):
    n = 1
    for d in shape:
        n *= d
    return TensorItem(name, tuple(shape), dtype, n * getattr(torch, dtype).itemsize)


# --------------------------------------------------------------------------- #
# Pure planning
# --------------------------------------------------------------------------- #
def test_client_names_are_exported_lazily_from_the_package():
    import sglang.srt.ray.rdt as rdt
    from sglang.srt.ray.rdt.trainer.client import WeightSyncClient, WeightSyncRankError

    assert rdt.WeightSyncClient is WeightSyncClient
    assert issubclass(rdt.WeightSyncRankError, WeightSyncError) and rdt.WeightSyncRankError is WeightSyncRankError
    with pytest.raises(AttributeError):
        rdt.NoSuchThing


def test_client_bucket_size_defaults_follow_the_bucket_device():
    from sglang.srt.ray.rdt.trainer.client import default_bucket_bytes

    assert default_bucket_bytes("cuda") == default_bucket_bytes("cuda:1") == 1 << 30
    assert default_bucket_bytes("cpu") == 256 << 20


def test_buckets_keep_order_align_offsets_and_fit_the_size():
    items = [item(f"w{i}", (10, 10)) for i in range(5)] + [item("b", (3,), "bfloat16")]
    buckets = plan_buckets(items, bucket_bytes=1000)
    assert [n for b in buckets for n in b.names] == [i.name for i in items]
    for b in buckets:
        assert all(s.offset % ALIGN == 0 for s in b.slices)
        assert b.extent <= 1024 or len(b.slices) == 1
    assert [len(b.slices) for b in buckets] == [2, 2, 2]  # 400 B + pad + 400 B fits 1000


def test_a_tensor_larger_than_the_bucket_gets_its_own_and_sizes_the_buffer():
    items = [item("small", (4,)), item("huge", (100, 100)), item("tail", (4,))]
    steps, buffer_bytes = plan_steps([items], bucket_bytes=1024)
    assert [r.bucket.names for s in steps for r in s.regions] == [["small"], ["huge"], ["tail"]]
    assert buffer_bytes >= 100 * 100 * 4


def test_rank_groups_share_one_buffer_side_by_side():
    assert group_ranks(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    g0 = [item("x", (64,)), item("y", (64,))]
    g1 = [item("x", (32,)), item("y", (32,))]
    steps, buffer_bytes = plan_steps([g0, g1], bucket_bytes=1024)
    for s in steps:
        assert [r.group for r in s.regions] == [0, 1]
        assert s.regions[1].offset >= s.regions[0].bucket.extent
        assert all(r.offset + r.bucket.extent <= buffer_bytes for r in s.regions)


def test_layout_check_names_the_parameter_expected_and_actual():
    layout = {"w": {"shape": [4, 4], "dtype": "bfloat16"}, "b": {"shape": [4], "dtype": "bfloat16"}}
    check_tensors([item("w", (4, 4), "bfloat16")], layout, "rank 0")
    with pytest.raises(WeightSyncError, match=r"'w' on rank 1.*dtype=float32.*dtype=bfloat16.*torch\.bfloat16"):
        check_tensors([item("w", (4, 4), "float32")], layout, "rank 1")
    with pytest.raises(WeightSyncError, match=r"shape=\[2, 4\].*shape=\[4, 4\].*own shard"):
        check_tensors([item("w", (2, 4), "bfloat16")], layout, "rank 1")
    with pytest.raises(WeightSyncError, match=r"no parameter 'ww'.*did you mean 'w'"):
        check_tensors([item("ww", (4, 4), "bfloat16")], layout, "rank 0")
    with pytest.raises(WeightSyncError, match=r"strict update: 1 parameters.*\['b'\]"):
        check_tensors([item("w", (4, 4), "bfloat16")], layout, "rank 0", strict=True)


def test_the_client_checks_a_layout_once_even_when_the_tensors_are_new(monkeypatch):
    """An update with the names, shapes and dtypes of the last one that passed
    is not checked again — also when its tensors live at new addresses (a
    trainer handing over fresh tensors every step); a new shape or dtype is."""
    from sglang.srt.ray.rdt.trainer import payloads

    calls = []
    monkeypatch.setattr(payloads, "check_tensors",
                        lambda items, layout, label, strict=False: calls.append(label)
                        or check_tensors(items, layout, label, strict=strict))
    layouts = [{"w": {"shape": [4, 4], "dtype": "float32"}, "b": {"shape": [4], "dtype": "float32"}}]
    check = payloads.LayoutCheck()

    def run(tensors):
        ps, groups = payloads.split_payloads(tensors, 1)
        return check.items_per_group(ps, groups, layouts, ["rank 0"], False,
                                     [payloads.signature(ps[g[0]]) for g in groups])

    first = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    items = run(first)
    assert calls == ["rank 0"] and [i.name for i in items[0]] == ["w", "b"]
    assert run(first) == items and len(calls) == 1  # the same tensors
    fresh = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    assert fresh["w"].data_ptr() != first["w"].data_ptr()
    assert run(fresh) == items and len(calls) == 1  # new tensors, same layout
    with pytest.raises(WeightSyncError, match=r"'w' on rank 0.*float64"):
        run({"w": torch.ones(4, 4, dtype=torch.float64), "b": torch.ones(4)})
    assert len(calls) == 2
    with pytest.raises(WeightSyncError, match=r"'w' on rank 0.*shape=\[2, 8\]"):
        run({"w": torch.ones(2, 8), "b": torch.ones(4)})
    assert len(calls) == 3
    run(fresh)  # the refused ones did not replace the layout that passed
    assert len(calls) == 3

# --------------------------------------------------------------------------- #
# The sender's guard (in process: fake NIXL registration and put)
# --------------------------------------------------------------------------- #
def fake_sender():
    log = SimpleNamespace(registered=[], deregistered=[], puts=[])
    sender = BucketSender(
        "cpu",
        register=lambda t: log.registered.append(t.data_ptr()),
        deregister=lambda t: log.deregistered.append(t.data_ptr()),
        put=lambda views: log.puts.append(views) or f"ref{len(log.puts)}",
    )
    return sender, log


def region(*named):
    slices, tensors, off = [], [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        slices.append((name, off, n, tuple(t.shape), str(t.dtype).replace("torch.", "")))
        tensors.append(t)
        off = (off + n + ALIGN - 1) // ALIGN * ALIGN
    return (0, slices, tensors)


def test_sender_refuses_to_overwrite_a_bucket_until_released():
    sender, log = fake_sender()
    sender.prepare(4096)
    assert len(log.registered) == 2  # two slots, registered once
    a, b = torch.arange(8, dtype=torch.float32), torch.full((8,), 7.0)
    assert sender.fill(0, "update-1/bucket-0", [region(("a", a))]) == [["ref1"]]
    # The put got views of the registered slot (zero copy), holding a's bytes.
    (view,) = log.puts[0]
    assert view.untyped_storage().data_ptr() == log.registered[0]
    assert torch.equal(view, a)

    with pytest.raises(BucketInFlightError, match="still in flight"):
        sender.fill(0, "update-1/bucket-2", [region(("a", b))])
    assert torch.equal(view, a)  # nothing was written
    with pytest.raises(BucketSenderError, match="held by 'update-1/bucket-0'"):
        sender.release(0, "update-1/bucket-2")  # a stale token frees nothing
    with pytest.raises(BucketInFlightError, match="resize"):
        sender.prepare(1 << 20)  # no re-allocation under a reader either

    sender.fill(1, "update-1/bucket-1", [region(("a", b))])  # the other slot is free
    sender.release(0, "update-1/bucket-0")
    sender.fill(0, "update-1/bucket-2", [region(("a", b))])
    assert torch.equal(view, b)
    assert sender.in_flight() == ["update-1/bucket-2", "update-1/bucket-1"]


def test_sender_hands_out_the_ref_of_a_layout_again_and_puts_only_new_layouts():
    """A ref is read when a rank pulls it, so a later fill of the same layout
    into the same slot returns the kept ref (with the new bytes in place)."""
    sender, log = fake_sender()
    sender.prepare(4096)
    a, b = torch.arange(8, dtype=torch.float32), torch.full((8,), 7.0)
    assert sender.fill(0, "u1/b0", [region(("a", a))]) == [["ref1"]]
    sender.release(0, "u1/b0")
    assert sender.fill(0, "u2/b0", [region(("a", b))]) == [["ref1"]]  # same layout: no put
    (view,) = log.puts[0]
    assert torch.equal(view, b) and len(log.puts) == 1
    sender.release(0, "u2/b0")
    # Another slot, or another layout, is another ref.
    assert sender.fill(1, "u2/b1", [region(("a", b))]) == [["ref2"]]
    assert sender.fill(0, "u3/b0", [region(("a", b[:4]))]) == [["ref3"]]
    assert sender.stats["puts"] == 3 and sender.stats["fills"] == 4
    sender.release(0, "u3/b0")
    sender.release(1, "u2/b1")
    # Growing the slots frees the old memory: its refs are not handed out again.
    sender.prepare(8192)
    assert sender.fill(0, "u4/b0", [region(("a", a))]) == [["ref4"]]


def test_sender_keeps_its_buffers_and_reregisters_only_to_grow():
    sender, log = fake_sender()
    sender.prepare(4096)
    sender.prepare(1024)
    assert len(log.registered) == 2 and not log.deregistered
    old = list(log.registered)
    sender.prepare(8192)
    assert log.deregistered == old and len(log.registered) == 4  # old ones dropped first
    assert sender.close() == 2 and len(log.deregistered) == 4
    with pytest.raises(BucketSenderError, match="closed"):
        sender.fill(0, "t", [region(("a", torch.zeros(2)))])


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
# Toy ranks: real Ray, real NIXL, no server
# --------------------------------------------------------------------------- #
def actor_options():
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {"runtime_env": {"env_vars": {"PYTHONPATH": path}}}


@pytest.fixture(scope="module")
def toy(ray_client):
    from client_actors import FakeRank, SpySender

    ray = ray_client
    # Started together (each imports sglang: tens of seconds on a small box).
    ranks = [FakeRank.options(**actor_options()).remote(i) for i in range(4)]
    spy = SpySender.options(**actor_options()).remote("cpu")
    ray.get([r.register_weight_for_rdt.remote() for r in ranks] + [spy.state.remote()], timeout=300)
    yield SimpleNamespace(
        ray=ray, ranks=ranks[:2], victim=ranks[2], lane_victim=ranks[3], spy=spy,
        names=["fake-0", "fake-1"],
    )
    for a in ranks + [spy]:
        ray.kill(a)


def new_weights(seed):
    from client_actors import deep_model

    return {n: p.detach().clone() for n, p in deep_model(seed).named_parameters()}


def toy_client(toy, **kw):
    kw.setdefault("bucket_bytes", 5000)  # one 32x32 weight + its bias per bucket
    return WeightSyncClient(toy.ranks, names=toy.names, sender=toy.spy, **kw)


def assert_ranks_hold(toy, weights, ranks=None):
    for r in ranks or toy.ranks:
        state = toy.ray.get(r.state.remote(), timeout=60)
        assert sorted(state) == sorted(weights)
        for n, t in weights.items():
            assert torch.equal(state[n], t), n


def test_double_buffering_never_changes_a_bucket_while_a_slow_rank_reads_it(toy):
    ray = toy.ray
    ray.get([toy.ranks[0].configure.remote(delay_s=0.0, fail=None),
             toy.ranks[1].configure.remote(delay_s=0.8, fail=None)])
    fills_before = len(ray.get(toy.spy.fill_log.remote()))
    pulls_before = [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks]
    weights = new_weights(seed=11)
    seen = []
    stats = toy_client(toy).update(
        weights, version="db-1", progress=lambda b, done, total: seen.append((done, total))
    )

    # Every byte landed where it was meant to, on the fast and the slow rank.
    assert_ranks_hold(toy, weights)
    n = len(stats.buckets)
    assert n >= 4 and seen == [(i + 1, n) for i in range(n)]
    assert stats.tensors == len(weights) and stats.ranks == 2
    assert stats.bytes == sum(t.numel() * 4 for t in weights.values())
    assert stats.bytes_moved == 2 * stats.bytes and stats.version == "db-1"
    # The spy sender puts with the default SGLANG_IPC: on one host, CPU
    # buckets are read with process_vm_readv, straight from the sender.
    assert stats.transport == "cma" and "transport=cma" in stats.summary()

    fills = ray.get(toy.spy.fill_log.remote())[fills_before:]
    pulls = [ray.get(r.log.remote())["pulls"][k:] for r, k in zip(toy.ranks, pulls_before)]
    assert len(fills) == n and all(len(p) == n for p in pulls)
    by_bucket = [[next(p for p in rank_pulls if p["names"] == f["names"]) for rank_pulls in pulls]
                 for f in fills]
    for k in range(2, n):
        # Bucket k reuses bucket k-2's buffer: written only after every rank's
        # pull of k-2 (the slow one's too) returned.
        assert fills[k]["slot"] == fills[k - 2]["slot"]
        assert fills[k]["start"] >= max(p["end"] for p in by_bucket[k - 2])
    # ... and bucket k+1 is filled while the slow rank still pulls bucket k
    # (double buffering). Timing under load varies, so one overlap is enough:
    # a serial client could never show any.
    overlaps = [fills[k + 1]["start"] < by_bucket[k][1]["end"] for k in range(1, n - 1)]
    assert any(overlaps), overlaps
    assert ray.get(toy.spy.in_flight.remote()) == [None, None]
    assert [ray.get(r.log.remote())["finalized"][-1] for r in toy.ranks] == ["db-1", "db-1"]


@pytest.mark.parametrize("transport", ["SGLANG_IPC", "nixl"])
def test_local_sender_keeps_buckets_in_the_callers_process(toy, transport):
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    weights = new_weights(seed=31 if transport == "nixl" else 32)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", bucket_bytes=5000,
                          transport=transport) as client:
        stats = client.update(weights, version=f"local-{transport}")
        assert client.sender.sender.state()["allocations"] == 1  # both slots, in this process
        assert client.sender.sender.in_flight() == [None, None]
    assert_ranks_hold(toy, weights)
    assert stats.transport == ("cma" if transport == "SGLANG_IPC" else "nixl")
    assert [ray.get(r.log.remote())["finalized"][-1] for r in toy.ranks] == [f"local-{transport}"] * 2
    with pytest.raises(ValueError, match="sender must be an actor handle or 'local'"):
        WeightSyncClient(toy.ranks, sender="remote")


def test_register_with_the_tensors_primes_the_buckets_so_no_update_puts(toy):
    """Bucket updates: register(tensors) puts the buckets the updates will
    fill and has every rank prepare its pulls (nothing written); every update
    then reuses those refs — the first pulls already find their plans."""
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    before = [ray.get(r.state.remote()) for r in toy.ranks]
    n_pulls = [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks]
    weights = new_weights(seed=47)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", bucket_bytes=5000) as client:
        client.register(weights)
        sender = client.sender.sender
        primed = sender.state()["puts"]
        assert primed >= 2 and sender.state()["fills"] == 0 and sender.in_flight() == [None, None]
        for r, state in zip(toy.ranks, before):  # nothing was written
            now = ray.get(r.state.remote())
            assert all(torch.equal(now[n], state[n]) for n in state)
        first = client.update(weights, version="primed-1")
        for t in weights.values():
            t.add_(1.0)
        second = client.update(weights, version="primed-2")
        assert sender.state()["puts"] == primed  # no update put anything
        assert sender.state()["fills"] == 2 * len(first.buckets)
        # The ranks hold the primed refs: every pull went over their call lanes.
        assert first.lane_calls == second.lane_calls == 2 * len(first.buckets)
        assert_ranks_hold(toy, weights)
        # An update of other layouts puts new refs (through Ray); at its end
        # the ranks let go of the refs it did not read.
        some = dict(reversed(list(weights.items())[:2]))  # bias first: another layout
        third = client.update(some, version="primed-3")
        assert third.lane_calls == 0
        for r in toy.ranks:
            lane = ray.get(r.get_weight_sync_status.remote())["lane"]
            assert lane["held_refs"] == len(third.buckets)
    for r, k in zip(toy.ranks, n_pulls):
        pulls = ray.get(r.log.remote())["pulls"][k:]
        assert len(pulls) == 2 * len(first.buckets) + len(third.buckets)
        assert all(p["plan_reused"] for p in pulls[: 2 * len(first.buckets)])
        assert ["lane" if p["thread"] == "rdt-lane" else "ray" for p in pulls] == (
            ["lane"] * (2 * len(first.buckets)) + ["ray"] * len(third.buckets))


def test_direct_export_reads_host_tensors_in_place_and_each_rank_ends_the_update_in_its_pull(toy):
    """export="direct" on CPU: the ranks read the driver's own tensors with
    process_vm_readv (no bucket), one pull_weights per rank that also ends the
    update there (no finalize call); the kept ref serves the next update."""
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    logs = [ray.get(r.log.remote()) for r in toy.ranks]
    weights = new_weights(seed=41)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct") as client:
        first = client.update(weights, version="direct-1")
        assert_ranks_hold(toy, weights)
        for t in weights.values():
            t.add_(1.0)  # in place: same addresses, so the same ref serves again
        second = client.update(weights, version="direct-2")
        assert client._direct_refs.reused == 1
        assert client.sender.sender is None  # no bucket memory was ever allocated
    assert_ranks_hold(toy, weights)
    for stats in (first, second):
        assert stats.transport == "cma" and stats.tensors == len(weights)
        assert stats.bytes == sum(t.numel() * 4 for t in weights.values())
        assert len(stats.buckets) == 1 and stats.end_seconds == 0.0
    for r, before in zip(toy.ranks, logs):
        log = ray.get(r.log.remote())
        pulls = log["pulls"][len(before["pulls"]):]
        assert [p["finalize"] for p in pulls] == [
            {"weight_version": f"direct-{k}", "flush_cache": True} for k in (1, 2)]
        # Ended in the pulls: exactly two ends, no separate finalize call.
        assert log["finalized"][len(before["finalized"]):] == ["direct-1", "direct-2"]
        st = ray.get(r.get_weight_sync_status.remote())
        assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (True, False, "direct-2")


def test_register_with_the_tensors_prepares_the_first_direct_update_and_writes_nothing(toy):
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    before = [ray.get(r.state.remote()) for r in toy.ranks]
    n_pulls = [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks]
    weights = new_weights(seed=44)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct") as client:
        with pytest.raises(WeightSyncError, match=r"no parameter '0.wieght'"):
            client.register({"0.wieght": weights["0.weight"]})  # checked before anything is put
        client.register(weights)
        for r, state in zip(toy.ranks, before):  # nothing was written, no pull ran
            now = ray.get(r.state.remote())
            assert all(torch.equal(now[n], state[n]) for n in state)
        assert [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks] == n_pulls
        assert client._direct_refs.reused == 0
        client.update(weights, version="prepared")
        # The first update sent the ref put at register, and each rank's pull
        # reused the plan its prepare_pull_weights made.
        assert client._direct_refs.reused == 1
        for r, k in zip(toy.ranks, n_pulls):
            assert [p["plan_reused"] for p in ray.get(r.log.remote())["pulls"][k:]] == [True]
    assert_ranks_hold(toy, weights)


def test_zero_copy_pulls_of_a_kept_ref_go_over_the_ranks_call_lane(toy):
    """Once a rank has read the kept ref through Ray, the next updates send
    its pull (with the update's end) over the rank's same-node lane: the same
    pull on the rank, bytes checked; a rank that no longer holds the ref says
    so and the call goes through Ray; lane=False never uses it."""
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    n_pulls = [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks]
    weights = new_weights(seed=45)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct") as client:
        stats = [client.update(weights, version="lane-1")]
        for k in (2, 3):
            for t in weights.values():
                t.add_(1.0)
            stats.append(client.update(weights, version=f"lane-{k}"))
            assert_ranks_hold(toy, weights)
        assert [s.lane_calls for s in stats] == [0, 2, 2]
        # A rank that dropped the ref (its trainer released it) answers before
        # anything moves; the client sends the same pull through Ray.
        ray.get(toy.ranks[0].release_weight_sync_mappings.remote(sglang_ipc_token()))
        for t in weights.values():
            t.mul_(0.5)
        stats.append(client.update(weights, version="lane-4"))
        assert stats[-1].lane_calls == 2  # both sent over the lane; rank 0 then through Ray
        assert_ranks_hold(toy, weights)
        st = ray.get(toy.ranks[1].get_weight_sync_status.remote())
        assert st["lane"]["open"] and st["lane"]["held_refs"] == 1
        assert (st["weights_consistent"], st["weight_version"]) == (True, "lane-4")
    for i, (r, k) in enumerate(zip(toy.ranks, n_pulls)):
        pulls = ray.get(r.log.remote())["pulls"][k:]
        threads = ["lane" if p["thread"] == "rdt-lane" else "ray" for p in pulls]
        assert threads == ["ray", "lane", "lane", "ray" if i == 0 else "lane"], (i, threads)
        assert [p["finalize"]["weight_version"] for p in pulls] == [f"lane-{k}" for k in (1, 2, 3, 4)]
    # Closed: the ranks hold nothing of this trainer any more.
    assert ray.get(toy.ranks[1].get_weight_sync_status.remote())["lane"]["held_refs"] == 0
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct",
                          lane=False) as client:
        client.update(weights, version="nolane-1")
        assert client.update(weights, version="nolane-2").lane_calls == 0


def sglang_ipc_token():
    from sglang.srt.ray.rdt.transport import sglang_ipc

    return sglang_ipc.sender_token()


def test_direct_export_failure_aborts_only_the_ranks_whose_pull_failed(toy):
    ray = toy.ray
    ray.get([toy.ranks[0].configure.remote(delay_s=0.0, fail=None),
             toy.ranks[1].configure.remote(delay_s=0.0, fail="disk on fire")])
    logs = [ray.get(r.log.remote()) for r in toy.ranks]
    weights = new_weights(seed=42)
    with WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct") as client:
        with pytest.raises(WeightSyncRankError, match=r"^rank 1 \(fake-1\) failed during pull of the "
                           r"trainer's tensors \(zero-copy\) and finalize: WeightSyncError: disk on fire"):
            client.update(weights, version="direct-3")
        after = [ray.get(r.log.remote()) for r in toy.ranks]
        # Rank 0 landed the whole update and ended it; only rank 1 is aborted.
        assert after[0]["finalized"][len(logs[0]["finalized"]):] == ["direct-3"]
        assert after[0]["aborts"] == logs[0]["aborts"]
        assert len(after[1]["aborts"]) == len(logs[1]["aborts"]) + 1
        assert after[1]["finalized"] == logs[1]["finalized"]
        assert_ranks_hold(toy, weights, ranks=[toy.ranks[0]])
        ray.get(toy.ranks[1].configure.remote(fail=None))
        client.update(weights, version="direct-4")
    assert_ranks_hold(toy, weights)


def test_direct_export_says_why_it_cannot_read_in_place_before_anything_moves(toy):
    ray = toy.ray
    logs = [ray.get(r.log.remote()) for r in toy.ranks]
    client = WeightSyncClient(toy.ranks, names=toy.names, sender="local", export="direct")
    elsewhere = {"transports": ["NIXL", "SGLANG_IPC"], "ipc_reach": {"node_id": "f" * 56, "gpus": []}}
    client.status = lambda: [elsewhere, elsewhere]  # ranks on another node
    with pytest.raises(WeightSyncError, match=r"export='direct': the ranks cannot read this trainer's "
                       r"tensors in place \(rank 0 \(fake-0\) is on another node .*\); "
                       r"nothing was sent"):
        client.update(new_weights(seed=43))
    assert [ray.get(r.log.remote()) for r in toy.ranks] == logs
    with pytest.raises(ValueError, match="export must be 'auto', 'direct' or 'buckets'"):
        WeightSyncClient(toy.ranks, export="inplace")


def test_auto_transport_needs_every_rank_to_accept_the_fast_path(toy):
    client = toy_client(toy)
    assert client.transport == "auto" and client.put_transport() == "SGLANG_IPC"
    client = toy_client(toy)
    client.status = lambda: [{"transports": ["NIXL", "SGLANG_IPC"]}, {}]  # an older rank
    assert client.put_transport() == "nixl"
    assert toy_client(toy, transport="nixl").put_transport() == "nixl"
    with pytest.raises(ValueError, match="transport must be 'auto', 'nixl' or 'SGLANG_IPC'"):
        toy_client(toy, transport="tcp")


def test_failing_rank_surfaces_as_one_error_naming_the_rank_and_aborts(toy):
    ray = toy.ray
    ray.get([toy.ranks[0].configure.remote(delay_s=0.0, fail=None),
             toy.ranks[1].configure.remote(delay_s=0.0, fail="disk on fire")])
    aborts = [len(ray.get(r.log.remote())["aborts"]) for r in toy.ranks]
    finalized = [len(ray.get(r.log.remote())["finalized"]) for r in toy.ranks]
    client = toy_client(toy)
    with pytest.raises(WeightSyncRankError) as err:
        client.update(new_weights(seed=12), version="never")
    e = err.value
    assert (e.rank, e.actor_name, e.aborted) == (1, "fake-1", True)
    assert isinstance(e.cause, WeightSyncError) and [r for r, _ in e.failures] == [1]
    assert re.search(r"^rank 1 \(fake-1\) failed during pull of bucket 1/\d+: "
                     r"WeightSyncError: disk on fire$", str(e)), str(e)
    # The session was aborted on every rank, never finalized; buffers are free.
    assert [len(ray.get(r.log.remote())["aborts"]) for r in toy.ranks] == [a + 1 for a in aborts]
    assert [len(ray.get(r.log.remote())["finalized"]) for r in toy.ranks] == finalized
    assert ray.get(toy.spy.in_flight.remote()) == [None, None]

    # Fixed, the same client updates again.
    ray.get(toy.ranks[1].configure.remote(fail=None))
    weights = new_weights(seed=13)
    client.update(weights, version="fixed")
    assert_ranks_hold(toy, weights)


def test_dead_rank_is_named_in_the_error(toy):
    ray = toy.ray
    ray.get(toy.ranks[0].configure.remote(delay_s=0.0, fail=None))
    victim = toy.victim
    client = WeightSyncClient([toy.ranks[0], victim], names=["fake-0", "victim"],
                              sender=toy.spy, bucket_bytes=5000)
    client.parameter_layouts()  # found alive ...
    ray.kill(victim)  # ... and gone before the update
    with pytest.raises(WeightSyncRankError, match=r"^rank 1 \(victim\) failed during pull of "
                       r"bucket 1/\d+: the actor died") as err:
        client.update(new_weights(seed=14), version="never")
    assert err.value.rank == 1
    assert ray.get(toy.spy.in_flight.remote()) == [None, None]


def test_a_rank_that_dies_during_a_lane_call_is_named_at_once(toy):
    """A lane call cannot hang on a dead rank: the client sees the rank's
    process exit within its liveness check, long before any timeout."""
    import threading

    ray = toy.ray
    ray.get(toy.ranks[0].configure.remote(delay_s=0.0, fail=None))
    victim = toy.lane_victim
    weights = new_weights(seed=46)
    client = WeightSyncClient([toy.ranks[0], victim], names=["fake-0", "lane-victim"],
                              sender="local", export="direct")
    client.update(weights, version="before")  # through Ray: both ranks now hold the ref
    calls = ray.get(victim.get_weight_sync_status.remote())["lane"]["calls"]
    ray.get(victim.configure.remote(delay_s=120.0))  # its next pull sleeps before reading

    def kill_once_the_lane_call_arrived():
        while ray.get(victim.get_weight_sync_status.remote())["lane"]["calls"] == calls:
            time.sleep(0.02)
        ray.kill(victim)

    killer = threading.Thread(target=kill_once_the_lane_call_arrived)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncRankError, match=r"^rank 1 \(lane-victim\) failed during pull of the "
                       r"trainer's tensors \(zero-copy\) and finalize: RankGone: the rank's process "
                       r"\(pid \d+\) exited during the call") as err:
        client.update(weights, version="never")
    killer.join()
    assert time.monotonic() - t0 < 30  # the pull would have slept 120 s; the timeout is longer
    assert [r for r, _ in err.value.failures] == [1]
    client.lanes.close()


def test_tensors_that_do_not_fit_are_rejected_before_any_byte_moves(toy):
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    before = [ray.get(r.state.remote()) for r in toy.ranks]
    logs = [ray.get(r.log.remote()) for r in toy.ranks]
    fills = len(ray.get(toy.spy.fill_log.remote()))
    client = toy_client(toy)
    weights = new_weights(seed=15)
    bad_dtype = {**weights, "0.weight": weights["0.weight"].double()}
    with pytest.raises(WeightSyncError, match=r"'0.weight' on rank 0 \(fake-0\).*float64.*float32"):
        client.update(bad_dtype)
    with pytest.raises(WeightSyncError, match=r"no parameter '0.wieght'.*did you mean '0.weight'"):
        client.update({"0.wieght": weights["0.weight"]})
    with pytest.raises(WeightSyncError, match=r"strict update"):
        client.update({"0.weight": weights["0.weight"]}, strict=True)
    with pytest.raises(WeightSyncError, match=r"per-rank update needs tensors for ranks 0..1: missing \[1\]"):
        client.update({0: weights})
    # No bucket was filled, no rank pulled, aborted or finalized anything.
    assert len(ray.get(toy.spy.fill_log.remote())) == fills
    for r, state, log in zip(toy.ranks, before, logs):
        assert ray.get(r.log.remote()) == log
        now = ray.get(r.state.remote())
        assert all(torch.equal(now[n], state[n]) for n in state)


def test_a_layout_that_passed_is_checked_again_once_it_changes(toy):
    """The client skips re-checking an update whose names, shapes and dtypes
    passed last time; a changed one is checked (and refused) again."""
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    client = toy_client(toy)
    try:
        weights = new_weights(seed=16)
        client.update(weights, version="a")
        weights2 = new_weights(seed=17)
        client.update(weights2, version="b")  # same layout: the cached check
        assert_ranks_hold(toy, weights2)
        bad = {**weights2, "0.weight": weights2["0.weight"].double()}
        with pytest.raises(WeightSyncError, match=r"'0.weight' on rank 0 \(fake-0\).*float64"):
            client.update(bad)
        assert_ranks_hold(toy, weights2)
    finally:
        client.close()


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


def test_engine_session_opens_after_validation_and_closes_after_every_pull(toy):
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.1, fail=None) for r in toy.ranks])
    engine = FakeEngine(toy.ranks)
    client = WeightSyncClient.from_engine(engine, sender=toy.spy, bucket_bytes=5000, lease_s=42)
    with pytest.raises(WeightSyncError, match="no parameter"):
        client.update({"nope": torch.zeros(1)})
    assert engine.calls == []  # rejected before the session: serving never paused

    pulls_before = [len(ray.get(r.log.remote())["pulls"]) for r in toy.ranks]
    weights = new_weights(seed=18)
    client.update(weights, version="e-1")
    (begin, t_begin, lease), (end, t_end, version) = engine.calls
    assert (begin, lease, end, version) == ("begin", 42, "end", "e-1")
    pulls = [p for r, k in zip(toy.ranks, pulls_before) for p in ray.get(r.log.remote())["pulls"][k:]]
    assert pulls and all(t_begin < p["start"] and p["end"] < t_end for p in pulls)
    assert_ranks_hold(toy, weights)

    ray.get(toy.ranks[0].configure.remote(fail="boom"))
    with pytest.raises(WeightSyncRankError, match=r"^rank 0 failed during pull of bucket 1/"):
        client.update(new_weights(seed=19), version="e-2")
    assert [c[0] for c in engine.calls] == ["begin", "end", "begin", "abort"]
    assert "boom" in engine.calls[-1][2]
    ray.get(toy.ranks[0].configure.remote(fail=None))


def test_per_rank_tensors_land_on_their_own_rank(toy):
    ray = toy.ray
    ray.get([r.configure.remote(delay_s=0.0, fail=None) for r in toy.ranks])
    w0, w1 = new_weights(seed=16), new_weights(seed=17)
    stats = toy_client(toy).update({0: w0, 1: w1}, version="per-rank")
    assert_ranks_hold(toy, w0, [toy.ranks[0]])
    assert_ranks_hold(toy, w1, [toy.ranks[1]])
    model_bytes = sum(t.numel() * 4 for t in w0.values())
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
    # Zero copy on the engine; the trainer's buffers were allocated once.
    assert {n: v["data_ptr"] for n, v in client.parameter_layouts(refresh=True)[0].items()} == ptrs
    assert ray_client.get(client.sender.sender.state.remote())["allocations"] == 1
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

    # The real SchedulerActor reads this process's own tensors in place, and
    # from the second update on gets the pull over its call lane.
    with WeightSyncClient.connect(port=server.port, namespace=ray_head.namespace,
                                  sender="local", export="direct") as direct_client:
        new = random_state_dict(tiny_model, 23)
        lane_calls = []
        for version in ("d-1", "d-2"):
            for t in new.values():
                t.mul_(-1.0)  # in place: the kept ref serves again
            stats = direct_client.update(new, version=version, strict=True)
            lane_calls.append(stats.lane_calls)
            res = server.generate(PROMPT, 16)
            assert res["output_ids"] == hf_greedy(tiny_model, PROMPT, 16, new)
            assert res["meta_info"]["weight_version"] == version
        assert lane_calls == [0, 1] and stats.transport == "cma"
        lane = ray_client.get(rank.get_weight_sync_status.remote(), timeout=60)["lane"]
        assert lane["open"] and lane["calls"] == 1 and lane["held_refs"] == 1
    assert ray_client.get(rank.get_weight_sync_status.remote(), timeout=60)["lane"]["held_refs"] == 0


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
