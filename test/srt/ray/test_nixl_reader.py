"""The NIXL reader (transport/nixl_reader.py) against real Ray + NIXL on CPU.

A rank that pulls from the same sender memory again reuses its NIXL transfer
request: one post, no notification to the sender. Every way the request's
records can go away under it (the sender deregistering memory, Ray dropping
the remote agent from its cache, the rank deregistering its parameters) must
release it first, and every pull must still land exactly its bytes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import wait_until
from rdt_actors import BucketTrainer, ToyRank, toy_model

DIRECT = "SGLANG_RDT_DIRECT_FETCH"


def _weights(seed: int):
    m = toy_model(seed)
    names = [n for n, _ in m.named_parameters()]
    return names, [p.detach().clone() for _, p in m.named_parameters()]


def _pull_and_check(ray, rank, trainer, seed: int):
    names, new = _weights(seed)
    ptrs = ray.get(rank.pointers.remote())
    (ref,) = ray.get(trainer.put.remote(new))
    stats = ray.get(rank.pull.remote([ref], names), timeout=60)
    state = ray.get(rank.state.remote())
    assert all(torch.equal(state[n], t) for n, t in zip(names, new)), f"seed {seed}: wrong bytes"
    assert ray.get(rank.pointers.remote()) == ptrs
    return stats


def _update(ray, rank, trainer, seed: int):
    """One whole update from ``trainer`` (two trainers may not write the same
    parameters within one update)."""
    stats = _pull_and_check(ray, rank, trainer, seed)
    ray.get(rank.finalize.remote(), timeout=60)
    return stats


def _reads(ray, rank):
    return ray.get(rank.status.remote())["nixl_reads"]


@pytest.fixture
def bucket_pair(ray_client, toy_rank):
    ray = ray_client
    ray.get(toy_rank.reset.remote(0), timeout=60)
    assert ray.get(toy_rank.register.remote())["registered"] is True
    trainer = BucketTrainer.remote()
    yield ray, toy_rank, trainer
    ray.get(toy_rank.set_env.remote(DIRECT, None))
    ray.kill(trainer)


def test_pulls_from_the_same_bucket_reuse_one_transfer_request(bucket_pair):
    ray, rank, trainer = bucket_pair
    before = _reads(ray, rank)
    first = _pull_and_check(ray, rank, trainer, 1)
    assert first["direct_refs"] == 1 and first["transport"] == "nixl"
    after_first = _reads(ray, rank)
    assert after_first["made"] == before["made"] + 1
    for seed in (2, 3, 4):  # new refs, new bytes, the same sender memory
        _pull_and_check(ray, rank, trainer, seed)
    now = _reads(ray, rank)
    assert now["made"] == after_first["made"]
    assert now["reused"] == after_first["reused"] + 3
    assert now["through_ray"] == before["through_ray"]


def test_reused_reads_send_the_sender_no_notification(bucket_pair):
    """Ray's own read notifies the sender (which never reads it); a kept
    request posts none. A read through Ray's path afterwards is the marker:
    once its notification has arrived, it must be the only one."""
    ray, rank, trainer = bucket_pair
    _pull_and_check(ray, rank, trainer, 4)
    ray.get(trainer.notifications.remote())  # drained
    before = _reads(ray, rank)
    for seed in (5, 6, 7):
        _pull_and_check(ray, rank, trainer, seed)
    assert _reads(ray, rank)["reused"] == before["reused"] + 3
    ray.get(rank.set_env.remote(DIRECT, "0"))  # ray.get: Ray's NIXL read, with its notification
    stats = _pull_and_check(ray, rank, trainer, 8)
    assert stats["direct_refs"] == 0
    seen = []
    wait_until(lambda: seen.append(ray.get(trainer.notifications.remote())) or sum(seen) >= 1,
               timeout=30, what="the marker read's notification at the sender")
    assert sum(seen) == 1, f"the sender got {sum(seen)} notifications for 1 read through Ray"


def test_sender_registering_new_memory_releases_the_old_request(bucket_pair):
    ray, rank, trainer = bucket_pair
    _pull_and_check(ray, rank, trainer, 9)
    before = _reads(ray, rank)
    ray.get(trainer.new_buffer.remote())
    # The new refs carry the sender's next metadata version: the agent is
    # loaded again, and the request made against the old one released first.
    _pull_and_check(ray, rank, trainer, 10)
    now = _reads(ray, rank)
    assert now["made"] == before["made"] + 1
    assert now["released"] >= before["released"] + 1
    _pull_and_check(ray, rank, trainer, 11)
    assert _reads(ray, rank)["reused"] == now["reused"] + 1


def test_rank_deregistering_its_parameters_releases_every_request(bucket_pair):
    ray, rank, trainer = bucket_pair
    _pull_and_check(ray, rank, trainer, 12)
    assert _reads(ray, rank)["kept"] >= 1
    assert ray.get(rank.deregister.remote()) >= 1  # NIXL deregistration: released first
    assert _reads(ray, rank)["kept"] == 0
    # Unregistered targets: read through Ray's manager (it registers them itself)
    before = _reads(ray, rank)
    stats = _pull_and_check(ray, rank, trainer, 13)
    assert stats["direct_refs"] == 1
    now = _reads(ray, rank)
    assert now["through_ray"] == before["through_ray"] + 1 and now["made"] == before["made"]


def test_remote_agent_dropped_by_rays_cache_is_never_read_through_again(ray_client):
    """With room for one remote agent in Ray's cache, a read from a second
    sender through Ray's own path drops the first sender's agent. The kept
    request made against it must be released before that, and the next pull
    from the first sender must make a new one — and land its bytes."""
    ray = ray_client
    rank = ToyRank.options(
        runtime_env={"env_vars": {"RAY_NIXL_REMOTE_AGENT_CACHE_MAXSIZE": "1"}}).remote(seed=0)
    a, b = BucketTrainer.remote(), BucketTrainer.remote()
    try:
        assert ray.get(rank.register.remote(), timeout=120)["registered"] is True
        _update(ray, rank, a, 21)
        assert _reads(ray, rank)["kept"] == 1
        ray.get(rank.set_env.remote(DIRECT, "0"))
        _update(ray, rank, b, 22)  # Ray's read: evicts a's agent
        after_ray = _reads(ray, rank)
        assert after_ray["kept"] == 0 and after_ray["released"] == 1
        ray.get(rank.set_env.remote(DIRECT, None))
        _update(ray, rank, a, 23)
        _update(ray, rank, b, 24)  # the reader's own load evicts a's again
        _update(ray, rank, a, 25)
        now = _reads(ray, rank)
        assert now["made"] == 4 and now["reused"] == 0 and now["released"] == 3
        assert now["kept"] == 1
    finally:
        for actor in (rank, a, b):
            ray.kill(actor)


def _pull_refs_and_check(ray, rank, trainer, seed: int, per_ref: int, between=None):
    """One pull of several refs, ``per_ref`` parameters each, put one after
    the other from consecutive parts of the trainer's buffer."""
    names, new = _weights(seed)
    refs, offset = [], 0
    for k in range(0, len(names), per_ref):
        if k and between is not None:
            between()
        (ref,) = ray.get(trainer.put.remote(new[k : k + per_ref], offset))
        refs.append(ref)
        offset += sum(t.nbytes for t in new[k : k + per_ref])
    groups = [names[k : k + per_ref] for k in range(0, len(names), per_ref)]
    stats = ray.get(rank.pull.remote(refs, groups), timeout=60)
    assert stats["direct_refs"] == len(refs)
    state = ray.get(rank.state.remote())
    assert all(torch.equal(state[n], t) for n, t in zip(names, new)), f"seed {seed}: wrong bytes"
    return stats


def test_refs_of_two_sender_versions_in_one_pull_all_land(bucket_pair):
    """The sender deregisters memory between two puts: the second ref needs
    the remote agent's newer metadata, which releases the request made for
    the first. Both are read (in two rounds), never a request in flight."""
    ray, rank, trainer = bucket_pair
    before = _reads(ray, rank)
    _pull_refs_and_check(ray, rank, trainer, 31, per_ref=2,
                         between=lambda: ray.get(trainer.bump_version.remote()))
    now = _reads(ray, rank)
    assert now["made"] == before["made"] + 3  # ref 0, ref 1, ref 0 again in round 2
    assert now["released"] >= before["released"] + 1
    assert now["through_ray"] == before["through_ray"]
    ray.get(rank.finalize.remote(), timeout=60)
    _pull_refs_and_check(ray, rank, trainer, 32, per_ref=2)  # one version again: both land


def test_more_refs_in_one_pull_than_kept_requests(bucket_pair):
    ray, rank, trainer = bucket_pair
    old = ray.get(rank.set_reader_max_kept.remote(1))
    try:
        _pull_refs_and_check(ray, rank, trainer, 33, per_ref=1)  # 4 refs, room for 1
        _pull_refs_and_check(ray, rank, trainer, 34, per_ref=1)
        _pull_and_check(ray, rank, trainer, 35)
        assert _reads(ray, rank)["kept"] == 1
    finally:
        ray.get(rank.set_reader_max_kept.remote(old))


# --------------------------------------------------------------------------- #
# The reader's bookkeeping against a stand-in agent (no Ray, no NIXL): every
# post and poll of a released request is recorded as a fault.
# --------------------------------------------------------------------------- #
class _Handle:
    def __init__(self, agent):
        self.agent, self.released = agent, False

    def release(self):
        self.released = True


class _Agent:
    """Transfers finish after ``polls`` checks; ``on_check(n)`` runs at check n."""

    def __init__(self, polls=3):
        self.polls, self.checks, self.on_check = polls, 0, None
        self.faults, self.removed = [], []
        self.progress = {}

    def initialize_xfer(self, *args):
        return _Handle(self)

    def transfer(self, h):
        if h.released:
            self.faults.append("posted after release")
        self.progress[id(h)] = 0
        return "PROC"

    def check_xfer_state(self, h):
        if h.released:
            self.faults.append("polled after release")
        self.checks += 1
        if self.on_check is not None:
            self.on_check(self.checks)
        self.progress[id(h)] = self.progress.get(id(h), 0) + 1
        return "DONE" if self.progress[id(h)] >= self.polls else "PROC"

    def remove_remote_agent(self, name):
        self.removed.append(name)

    def add_remote_agent(self, meta):
        pass

    def deregister_memory(self, *args):
        pass


class _Target:
    nbytes, is_cuda = 4, False

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class _Dtype:
    itemsize = 4


def _meta(version=0, remote="A"):
    import types

    return types.SimpleNamespace(
        nixl_agent_name=remote, nixl_agent_meta_version=version, nixl_agent_meta=b"m",
        nixl_serialized_descs=b"d", tensor_meta=[((1,), _Dtype)], tensor_device="cpu")


@pytest.fixture
def fake_reader(monkeypatch):
    from collections import OrderedDict
    import types

    from sglang.srt.ray.rdt.transport import compat, nixl_reader

    agent = _Agent()
    mgr = types.SimpleNamespace(_remote_agents=OrderedDict(), get_nixl_agent=lambda: agent)
    monkeypatch.setattr(compat, "transport_manager", lambda name: mgr)
    monkeypatch.setattr(compat, "ray_nixl_remote_agent_cache_size", lambda: 4)
    monkeypatch.setattr(compat, "ray_nixl_registered", lambda m, t: True)
    monkeypatch.setattr(nixl_reader.NixlReader, "_descs", staticmethod(lambda a, m, t: (None, None)))
    return nixl_reader.NixlReader(), agent


def test_a_deregistration_on_the_reading_thread_mid_read_neither_hangs_nor_frees_the_request(fake_reader):
    """A finalizer on the reading thread (Ray's fetch request cleaning up)
    deregisters memory while the read polls: it cannot wait for its own
    thread, so the request is released once the read is done with it."""
    import threading

    reader, agent = fake_reader
    target = _Target(1)
    reader.read([("o", _meta(), [target])], 5)
    agent.checks = 0
    agent.on_check = lambda n: n == 1 and agent.deregister_memory("region")
    done = []
    t = threading.Thread(target=lambda: done.append(reader.read([("o", _meta(), [target])], 5)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the reading thread waited for itself"
    assert done and done[0] == [[target]]
    assert agent.faults == []
    assert reader.status()["kept"] == 0 and reader.counts["released"] == 1


def test_a_remote_removed_from_another_thread_waits_for_the_read_in_flight(fake_reader):
    """Another thread removes the sender's agent (Ray's own read evicting
    it) while a read of two rounds is in flight on it: the removal waits,
    and no request on that agent is posted or polled after its release."""
    import threading

    reader, agent = fake_reader
    target = _Target(1)
    agent.polls = 50
    started = threading.Event()
    agent.on_check = lambda n: n == 1 and started.set()
    # The same target twice: two rounds (one request per key and round)
    reader_thread = threading.Thread(
        target=lambda: reader.read([("o1", _meta(), [target]), ("o2", _meta(), [target])], 30),
        daemon=True)
    reader_thread.start()
    assert started.wait(10)
    remover = threading.Thread(target=lambda: agent.remove_remote_agent("A"), daemon=True)
    remover.start()
    reader_thread.join(30)
    remover.join(30)
    assert not reader_thread.is_alive() and not remover.is_alive()
    assert agent.faults == []
    assert agent.removed == ["A"] and reader.status()["kept"] == 0


def test_a_newer_sender_version_in_one_read_never_touches_a_released_request(fake_reader):
    reader, agent = fake_reader
    a, b = _Target(1), _Target(2)
    out = reader.read([("o1", _meta(0), [a]), ("o2", _meta(1), [b])], 5)
    assert out == [[a], [b]] and agent.faults == []
    assert reader.counts["made"] == 3 and agent.removed == ["A", "A"]
