"""The logic behind the same-node/same-GPU fast path that runs without a GPU:
a broken transfer on a rank, the client's route (:meth:`WeightSyncClient.route`:
the trainer's own tensors or bucket slots, lanes or Ray, and the refusal of
NIXL for a rank on the trainer's GPU) over rank statuses made here, and the
receiver's warning about a NIXL pull that fell back to TCP.

The GPU side (CUDA IPC reads, a trainer dying around one) is in
``gpu/test_gpu_faults.py``; its speed is measured by
``benchmark/rdt_weight_sync/bench_pull.py --device cuda --same-gpu``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.ray.rdt.defaults import SGLANG_IPC
from sglang.srt.ray.rdt.engine.plan import TensorSpec
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError
from sglang.srt.ray.rdt.trainer.client import Route, WeightSyncClient
from sglang.srt.ray.rdt.transport import cuda_driver, same_node
from sglang.srt.ray.rdt.transport.metadata import ReadResult

NODE, OTHER_NODE, GPU0, GPU1 = "node-a", "node-b", "GPU-0000", "GPU-1111"


class FakeSource:
    """A pull source (engine/sources.py's interface) that writes ``value`` into
    its targets and reports the read as ``path`` taking ``seconds``; or fails
    after the copy when ``fail`` is set."""

    def __init__(self, shape, value: float, path: str = "cma", seconds: float = 0.001,
                 nbytes=None, fail: bool = False):
        self.shape, self.value, self.path, self.seconds = tuple(shape), value, path, seconds
        self.nbytes, self.fail = nbytes, fail

    def specs(self, timeout_s):
        return [TensorSpec(self.shape, torch.float32)]

    def writer(self):
        return Writer("process:test", "the test")

    def read(self, targets, device, timeout_s):
        for t in targets.tensors:
            t.fill_(self.value)
        if self.fail:
            raise RuntimeError("the sender went away mid-read")
        n = self.nbytes if self.nbytes is not None else int(targets.nbytes.sum())
        return ReadResult(self.path, len(targets.tensors), n, self.seconds)


def _receiver():
    params = {"w": torch.zeros(4, 4)}
    return params, RdtWeightReceiver(lambda: params)


def test_a_broken_transfer_leaves_the_rank_inconsistent():
    """Bytes may have landed: the rank's weights are inconsistent until a complete update ends."""
    params, recv = _receiver()
    with pytest.raises(WeightsInconsistentError, match="the sender went away mid-read"):
        recv.pull([FakeSource((4, 4), 5.0, fail=True)], ["w"])
    assert torch.equal(params["w"], torch.full((4, 4), 5.0))
    assert recv.state.consistent is False


# --------------------------------------------------------------------------- #
# The route: WeightSyncClient.route() over rank statuses made here
# --------------------------------------------------------------------------- #
class StubLanes:
    """The client's lanes with the outcome of opening them set by the test:
    ``reachable`` are the ranks whose lane opened."""

    def __init__(self, reachable, enabled: bool = True):
        self.reachable, self.enabled = set(reachable), enabled
        self.opened_with = None

    def open(self, ranks, statuses, call_timeout_s, device=None, allocating=None):
        if self.enabled and self.opened_with is None:
            self.opened_with = [st["ipc_reach"]["node_id"] for st in statuses]

    def link(self, rank):
        return object() if self.enabled and rank in self.reachable else None


def _status(node=NODE, gpus=(GPU0,), uuid=GPU0, transports=("NIXL", SGLANG_IPC)):
    return {"transports": list(transports), "ipc_reach": {"node_id": node, "gpus": list(gpus)},
            "device_uuid": uuid}


@pytest.fixture
def trainer_on(monkeypatch):
    """A client whose trainer runs on ``device`` of node ``NODE`` (its GPU
    is ``GPU0``), over ranks with the given statuses and reachable lanes."""
    monkeypatch.setattr(same_node, "node_id", lambda: NODE)
    monkeypatch.setattr(cuda_driver, "device_uuid", lambda ordinal: {0: GPU0, 1: GPU1}[ordinal])

    def make(device, statuses, reachable, **kwargs):
        client = WeightSyncClient([object() for _ in statuses], names=[f"r{i}" for i in range(len(statuses))],
                                  device=device, **kwargs)
        client.lanes = StubLanes(reachable, enabled=client.lanes.enabled)
        client._statuses = statuses
        return client

    return make


def test_ranks_on_the_trainers_gpu_read_its_own_tensors_over_their_lanes(trainer_on):
    client = trainer_on("cuda:0", [_status(), _status(gpus=(GPU0, GPU1), uuid=GPU1)], {0, 1})
    assert client.route() == Route(direct=True, lanes={0, 1}, ref_transport=None, why_not_direct=None)
    assert client.lanes.opened_with == [NODE, NODE]


def test_a_rank_that_does_not_see_the_trainers_gpu_gets_buckets_and_is_named(trainer_on):
    client = trainer_on("cuda:0", [_status(), _status(gpus=(GPU1,), uuid=GPU1)], {0, 1})
    assert client.route() == Route(False, {0, 1}, None, f"rank 1 (r1) does not see this trainer's GPU {GPU0}")
    # export="direct" fails before anything moves, saying why.
    client = trainer_on("cuda:0", [_status(), _status(gpus=(GPU1,), uuid=GPU1)], {0, 1}, export="direct")
    with pytest.raises(WeightSyncError, match=r"export='direct': the ranks cannot read this trainer's tensors in "
                       rf"place \(rank 1 \(r1\) does not see this trainer's GPU {GPU0}\); nothing was sent"):
        client.route()


def test_a_rank_on_another_node_pulls_slot_refs_through_ray_and_is_named(trainer_on):
    statuses = [_status(), _status(node=OTHER_NODE, gpus=(GPU0,), uuid=GPU0)]
    route = trainer_on("cuda:0", statuses, {0}).route()
    assert (route.direct, route.lanes, route.ref_transport) == (False, {0}, SGLANG_IPC)
    assert route.why_not_direct == "rank 1 (r1) cannot be reached over a same-node lane"
    # A rank elsewhere that does not accept SGLANG_IPC: NIXL for the slot refs.
    statuses[1] = _status(node=OTHER_NODE, gpus=("GPU-2222",), uuid="GPU-2222", transports=("NIXL",))
    route = trainer_on("cuda:0", statuses, {0}).route()
    assert (route.direct, route.lanes, route.ref_transport) == (False, {0}, "nixl")
    # transport="SGLANG_IPC" where a Ray rank cannot take it: refused, named.
    with pytest.raises(WeightSyncError, match=r"transport='SGLANG_IPC', but not every rank accepts it"):
        trainer_on("cuda:0", statuses, {0}, transport="SGLANG_IPC").route()


def test_host_memory_tensors_are_read_in_place_only_when_asked(trainer_on):
    statuses = [_status(gpus=()), _status(gpus=())]
    route = trainer_on("cpu", statuses, {0, 1}).route()
    assert route == Route(False, {0, 1}, None, "host-memory tensors are read in place only with export='direct'")
    assert trainer_on("cpu", statuses, {0, 1}, export="direct").route() == Route(True, {0, 1}, None, None)
    assert trainer_on("cpu", statuses, {0, 1}, export="buckets").route().why_not_direct == "export='buckets'"


def test_mixed_ranks_go_each_their_own_way(trainer_on):
    """One rank on the trainer's GPU, one on another GPU of the node that does
    not see it, one on another node without SGLANG_IPC: lanes for the first
    two, NIXL refs for the third, buckets for all (the first reason is named)."""
    statuses = [_status(), _status(gpus=(GPU1,), uuid=GPU1),
                _status(node=OTHER_NODE, gpus=("GPU-2222",), uuid="GPU-2222", transports=("NIXL",))]
    route = trainer_on("cuda:0", statuses, {0, 1}).route()
    assert (route.direct, route.lanes, route.ref_transport) == (False, {0, 1}, "nixl")
    assert route.why_not_direct == "rank 2 (r2) cannot be reached over a same-node lane"


def test_nixl_is_refused_for_a_rank_on_the_trainers_own_gpu(trainer_on):
    statuses = [_status(), _status(node=OTHER_NODE, gpus=("GPU-2222",), uuid="GPU-2222")]
    client = trainer_on("cuda:0", statuses, {0, 1}, transport="nixl")
    assert client.lanes.enabled is False  # transport="nixl": Ray calls and NIXL refs only
    with pytest.raises(WeightSyncError, match=r"rank 0 \(r0\) run\(s\) on this trainer's GPU, and NIXL cannot "
                       r"move bytes between two processes of one GPU .* Use transport='auto' or 'SGLANG_IPC'"):
        client.route()
    # The same ranks with the trainer on its node's other GPU: NIXL is fine.
    route = trainer_on("cuda:1", statuses, {0, 1}, transport="nixl").route()
    assert (route.direct, route.lanes, route.ref_transport) == (False, set(), "nixl")
    assert route.why_not_direct == "rank 0 (r0), rank 1 (r1) cannot be reached over a same-node lane"


def test_the_route_is_kept_until_a_lane_breaks(trainer_on):
    client = trainer_on("cuda:0", [_status(), _status()], {0, 1})
    first = client.route()
    assert first.direct and client.route() is first  # cached
    client.lanes.reachable.discard(1)  # rank 1's lane broke
    again = client.route()
    assert again is not first
    assert (again.direct, again.lanes, again.ref_transport) == (False, {0}, SGLANG_IPC)
    assert again.why_not_direct == "rank 1 (r1) cannot be reached over a same-node lane"


# --------------------------------------------------------------------------- #
# The receiver's warning about a slow NIXL pull
# --------------------------------------------------------------------------- #
def test_a_slow_large_nixl_pull_is_warned_about_once_with_the_fix(caplog):
    from sglang.srt.ray.rdt.engine import receiver as receiver_mod

    params = {"w": torch.zeros(4)}
    recv = RdtWeightReceiver(lambda: params)
    big, small = 8 << 30, 1 << 20
    with caplog.at_level(logging.WARNING, logger=receiver_mod.__name__):
        recv.pull([FakeSource((4,), 1.0, path="nixl", seconds=0.03, nbytes=big)], ["w"])  # fast
        recv.pull([FakeSource((4,), 1.0, path="nixl", seconds=17.0, nbytes=small)], ["w"])  # small
        recv.pull([FakeSource((4,), 1.0, path="cma", seconds=17.0, nbytes=big)], ["w"])  # not NIXL
        assert not [r for r in caplog.records if "NIXL pull" in r.getMessage()]
        recv.pull([FakeSource((4,), 1.0, path="nixl", seconds=17.0, nbytes=big)], ["w"])  # 0.5 GB/s
        recv.pull([FakeSource((4,), 1.0, path="nixl", seconds=17.0, nbytes=big)], ["w"])
    recv.end_of_update()
    msgs = [r.getMessage() for r in caplog.records if "NIXL pull" in r.getMessage()]
    assert len(msgs) == 1
    assert "a NIXL pull of 8192.0 MiB ran at 0.51 GB/s" in msgs[0]
    assert "SGLANG_IPC" in msgs[0] and "expandable_segments" in msgs[0]


# --------------------------------------------------------------------------- #
# The rank core (the SchedulerActor's code path) around a toy model, real Ray
# and a real SGLANG_IPC ref (process_vm_readv on CPU)
# --------------------------------------------------------------------------- #
import ray  # noqa: E402

from rdt_actors import ToyTrainer, toy_model  # noqa: E402


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class CoreRank:
    def __init__(self):
        from sglang.test.rdt_standalone import standalone_rank
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

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def test_rank_core_pulls_a_sglang_ipc_ref_under_a_pause_and_ends_the_update(ray_client):
    """Paused (miles' way), the rank reads a SGLANG_IPC ref with process_vm_readv into its live parameters;
    finalize ends the update; unpaused, a pull is refused with nothing written."""
    rank, trainer = CoreRank.remote(), ToyTrainer.remote("SGLANG_IPC")
    try:
        names = [n for n, _ in toy_model(1).named_parameters()]
        new = [p.detach().clone() for _, p in toy_model(1).named_parameters()]
        ray_client.get(rank.set_paused.remote(True))
        (ref,) = ray_client.get(trainer.put.remote(new))
        stats = ray_client.get(rank.pull.remote([ref], names), timeout=60)
        assert stats["transports"] == ["cma"] and stats["tensors"] == len(names)
        assert ray_client.get(rank.finalize.remote(), timeout=60)["success"]
        got = ray_client.get(rank.params.remote())
        assert all(torch.equal(got[n], t) for n, t in zip(names, new))
        ray_client.get(rank.set_paused.remote(False))
        (ref,) = ray_client.get(trainer.put.remote([t + 1 for t in new]))
        with pytest.raises(Exception, match="generation is not paused"):
            ray_client.get(rank.pull.remote([ref], names), timeout=60)
        got = ray_client.get(rank.params.remote())
        assert all(torch.equal(got[n], t) for n, t in zip(names, new))
    finally:
        ray_client.kill(rank)
        ray_client.kill(trainer)
