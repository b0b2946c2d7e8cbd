"""The logic behind the same-GPU (colocated) fast path that runs without a GPU:
the garbage-collector pause around updates, the trainer's choice between its
own tensors and buckets, the refusal of NIXL for a rank on the trainer's GPU,
and the warning about a NIXL pull that fell back to TCP.

The GPU side (CUDA IPC copies, zero-copy updates) is measured by
``benchmark/rdt_weight_sync/bench_pull.py --device cuda --same-gpu``.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from sglang.srt.ray.rdt import gc_pause
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.trainer import direct

NODE, GPU0, GPU1 = "node-a", "GPU-0000", "GPU-1111"


@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    for h in gc_pause.holders():
        gc_pause.resume(h)
    (gc.enable if was else gc.disable)()


def test_gc_is_off_while_any_holder_holds_and_back_on_after_the_last(gc_on):
    assert gc_pause.pause("trainer update")
    assert not gc.isenabled()
    assert not gc_pause.pause("rank weight update")  # nested: already off
    assert not gc_pause.resume("trainer update")
    assert not gc.isenabled()  # the rank still holds it
    assert gc_pause.resume("rank weight update")
    assert gc.isenabled()


def test_gc_pause_leaves_a_collector_the_process_turned_off_alone(gc_on):
    gc.disable()
    with gc_pause.paused("trainer update"):
        assert not gc.isenabled()
    assert not gc.isenabled()  # not ours to turn on


def test_gc_pause_is_idempotent_per_holder_and_can_be_switched_off(gc_on, monkeypatch):
    assert gc_pause.pause("x")
    assert not gc_pause.pause("x")
    assert gc_pause.resume("x")
    assert not gc_pause.resume("x")  # nothing held
    monkeypatch.setenv("SGLANG_RDT_PAUSE_GC", "0")
    with gc_pause.paused("y"):
        assert gc.isenabled()


def _status(node=NODE, gpus=(GPU0,), uuid=GPU0, transports=("NIXL", "SGLANG_IPC")):
    return {"transports": list(transports), "ipc_reach": {"node_id": node, "gpus": list(gpus)},
            "device_uuid": uuid}


def test_trainer_tensors_are_read_directly_only_when_every_rank_sees_the_gpu():
    labels = ["rank 0", "rank 1"]
    ok = [_status(), _status(gpus=(GPU0, GPU1), uuid=GPU1)]
    assert direct.ranks_blocker(ok, (NODE, GPU0), labels) is None
    assert "another node" in direct.ranks_blocker([_status(), _status(node="b")], (NODE, GPU0), labels)
    assert "does not see" in direct.ranks_blocker(
        [_status(), _status(gpus=(GPU1,), uuid=GPU1)], (NODE, GPU0), labels)
    assert "does not accept" in direct.ranks_blocker(
        [_status(transports=("NIXL",)), _status()], (NODE, GPU0), labels)
    # an older rank that does not say where it is: buckets
    assert direct.ranks_blocker([{"transports": ["NIXL", "SGLANG_IPC"]}], (NODE, GPU0),
                                ["rank 0"]) is not None
    assert "CUDA" in direct.ranks_blocker(ok, None, labels)


def test_only_ranks_on_the_trainers_own_gpu_count_as_sharing_it():
    statuses = [_status(uuid=GPU0), _status(gpus=(GPU0, GPU1), uuid=GPU1), _status(node="b")]
    assert direct.shared_gpu_ranks(statuses, (NODE, GPU0), ["r0", "r1", "r2"]) == ["r0"]
    assert direct.shared_gpu_ranks(statuses, None, ["r0", "r1", "r2"]) == []


def test_tensors_are_put_as_they_are_only_when_contiguous_on_the_clients_device():
    x = torch.zeros(4, 4)
    assert direct.tensors_blocker([{"a": x}], "cpu") is None
    assert "not contiguous" in direct.tensors_blocker([{"a": x.t()}], "cpu")
    if torch.cuda.is_available():
        assert "is on cpu" in direct.tensors_blocker([{"a": x}], "cuda:0")


def test_a_slow_large_nixl_pull_is_warned_about_once_with_the_fix(caplog):
    from sglang.srt.ray.rdt.engine.nixl_traps import NixlTrapWarnings

    traps = NixlTrapWarnings(device=None)
    writes = [(["w"], Writer("actor:abc", "actor Trainer(abc)"))]
    with caplog.at_level(logging.WARNING):
        traps.after_pull(8 << 30, 17.0, writes)  # 0.5 GB/s, as NIXL on one H200
        traps.after_pull(8 << 30, 17.0, writes)
        traps.after_pull(8 << 30, 0.03, writes)  # fast: nothing to say
        traps.after_pull(1 << 20, 17.0, writes)  # small: nothing to say
    msgs = [r.getMessage() for r in caplog.records if "NIXL pull" in r.getMessage()]
    assert len(msgs) == 1
    assert "SGLANG_IPC" in msgs[0] and "0.51 GB/s" in msgs[0]


# --------------------------------------------------------------------------- #
# The rank core (the SchedulerActor's code path) around a toy model, real Ray
# and a real SGLANG_IPC ref (process_vm_readv on CPU)
# --------------------------------------------------------------------------- #
import ray  # noqa: E402

from rdt_actors import ToyTrainer, toy_model  # noqa: E402


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class CoreRank:
    def __init__(self):
        from sglang.srt.ray.rdt.engine.standalone import standalone_rank
        from sglang.srt.ray.rdt.transport import sglang_ipc

        self.model = toy_model(0)
        self.sync = standalone_rank(self.model, transports=["NIXL", sglang_ipc.register()])

    def set_paused(self, paused: bool):
        self.sync.port.is_paused = paused
        if not paused:
            self.sync.on_generation_continued()  # what /continue_generation tells the rank
        return True

    def begin(self):
        return self.sync.begin()

    def pull(self, refs, names):
        return self.sync.pull(refs, names)

    def finalize(self):
        return self.sync.finalize("v")

    def gc_enabled(self) -> bool:
        return gc.isenabled()


def test_rank_core_keeps_gc_off_while_paused_between_updates_and_on_after_a_session(ray_client):
    """Paused (miles' way), a collection pending at an update's end would fire
    inside the next update's first call: collection stays off until
    generation continues. Inside a session, it is back on when the update ends."""
    rank, trainer = CoreRank.remote(), ToyTrainer.remote("SGLANG_IPC")
    try:
        names = [n for n, _ in toy_model(1).named_parameters()]
        new = [p.detach().clone() for _, p in toy_model(1).named_parameters()]
        ray_client.get(rank.set_paused.remote(True))
        assert ray_client.get(rank.gc_enabled.remote())
        (ref,) = ray_client.get(trainer.put.remote(new))
        stats = ray_client.get(rank.pull.remote([ref], names), timeout=60)
        assert stats["direct_refs"] == 1 and stats["transport"] == "cma"
        assert not ray_client.get(rank.gc_enabled.remote())
        ray_client.get(rank.finalize.remote(), timeout=60)
        assert not ray_client.get(rank.gc_enabled.remote())  # still paused: still off
        ray_client.get(rank.set_paused.remote(False))
        assert ray_client.get(rank.gc_enabled.remote())
        # a session instead of a pause: on again when the update ends
        ray_client.get(rank.begin.remote(), timeout=60)
        (ref,) = ray_client.get(trainer.put.remote(new))
        ray_client.get(rank.pull.remote([ref], names), timeout=60)
        assert not ray_client.get(rank.gc_enabled.remote())
        ray_client.get(rank.finalize.remote(), timeout=60)
        assert ray_client.get(rank.gc_enabled.remote())
    finally:
        ray_client.kill(rank)
        ray_client.kill(trainer)


def test_a_zero_copy_ref_is_put_again_only_when_the_tensors_moved():
    """The kept ref serves again for tensors at the same addresses (new tensor
    objects over the same storage, as state_dict() gives); a moved or
    re-shaped tensor gets a new put."""
    puts = []

    def put(tensors):
        puts.append([t.data_ptr() for t in tensors])
        return object()

    w = [torch.zeros(8, 4), torch.ones(16)]
    cache = direct.DirectRefs()
    first = cache.ref_for(0, [t.detach() for t in w], put)
    assert cache.ref_for(0, [t.detach() for t in w], put) is first  # same storage, new objects
    assert len(puts) == 1 and cache.reused == 1
    w[1] = torch.ones(16)  # new storage
    second = cache.ref_for(0, w, put)
    assert second is not first and len(puts) == 2
    assert cache.ref_for(0, [w[0].view(4, 8), w[1]], put) is not second  # same bytes, new shape
    cache.clear()
    assert cache.ref_for(0, w, put) is not None and len(puts) == 4
