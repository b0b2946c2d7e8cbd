"""The rank core (rdt/engine/rank_sync.py) around a plain model: the same code a
SchedulerActor runs, driven through its scheduler-facing port
(rdt/engine/standalone.py). Real pulls through it are in test_client.py
(FakeRank) and the server tests."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import wait_until

from sglang.srt.ray.rdt.engine.rank_sync import NOT_PAUSED, failure_kind
from sglang.srt.ray.rdt.engine.standalone import standalone_rank
from sglang.srt.ray.rdt.errors import (
    WeightsInconsistentError,
    WeightSyncError,
    WeightUpdateConflictError,
)


@pytest.fixture
def rank():
    model = torch.nn.Linear(4, 2)
    sync = standalone_rank(model, rank="test", pull_timeout_s=5)
    sync.safe_point.lending = True  # whatever SGLANG_RDT_LEND_SAFE_POINT says here
    yield sync
    sync.loop.stop()
    sync.shutdown()


def test_failure_kinds_of_pull_errors():
    # Broken transfers and conflicts are counted by the update state itself.
    assert failure_kind(WeightsInconsistentError("torn")) is None
    assert failure_kind(WeightUpdateConflictError("two writers")) is None
    assert failure_kind(WeightSyncError("bad name")) == "rejected"
    assert failure_kind(TimeoutError("slow")) == "other"


def test_work_runs_on_the_loop_thread_not_the_callers(rank):
    seen = []
    rank.port.named_parameters = lambda: (seen.append(threading.get_ident()) or iter(()))
    rank.parameter_checksums()
    assert seen and seen[0] == rank.loop._thread.ident != threading.get_ident()


def test_pull_is_refused_unless_paused_or_in_a_session_and_counted(rank):
    with pytest.raises(WeightSyncError, match=NOT_PAUSED) as e:
        rank.pull([object()], ["weight"])
    assert "POST /pause_generation" in str(e.value)  # the message names the fix
    assert rank.state.status()["failures"] == {"rejected": 1}
    # paused: the call itself is checked next (before any byte moves)
    rank.port.is_paused = True
    with pytest.raises(WeightSyncError, match="expected a ray.ObjectRef"):
        rank.pull([object()], ["weight"])
    assert rank.state.status()["failures"] == {"rejected": 2}


def test_a_busy_rank_refuses_even_when_paused(rank):
    rank.port.is_paused = True
    rank.port.idle = lambda: False
    with pytest.raises(WeightSyncError, match="a batch is still running"):
        rank.pull([object()], ["weight"])


def test_session_lifecycle_through_the_port(rank):
    assert rank.begin() == {"success": True}
    assert rank.port.is_session_open and rank.state.update_open
    out = rank.finalize(weight_version="v7")
    assert out["success"] and out["weight_version"] == "v7"
    assert not rank.port.is_session_open and not rank.state.update_open
    st = rank.status()
    assert st["weights_consistent"] and st["weight_version"] == "v7" and st["updates"] == 1
    assert rank.stats()["last_update"]["weight_version"] == "v7"


def test_finalize_without_pause_or_session_is_refused(rank):
    with pytest.raises(WeightSyncError, match="refusing to finalize while generation may run"):
        rank.finalize("v1")
    assert rank.port.version is None  # refused before the version moved
    assert rank.state.status()["updates"] == 0


def test_abort_closes_the_session_without_a_version(rank):
    rank.begin()
    status = rank.abort("trainer died")
    assert not rank.port.is_session_open and not rank.state.update_open
    assert status["weights_consistent"]  # nothing was written
    assert rank.port.version is None


def test_layout_names_every_parameter(rank):
    layout = rank.parameter_layout()
    assert set(layout) == {"weight", "bias"}
    assert layout["weight"]["shape"] == [2, 4] and layout["weight"]["dtype"] == "float32"


def test_a_pull_ends_the_update_only_after_it_landed_and_checks_finalize_first(rank):
    rank.port.is_paused = True
    with pytest.raises(WeightSyncError, match=r"finalize= takes weight_version and flush_cache, "
                       r"not \['version'\]"):
        rank.pull([object()], ["weight"], finalize={"version": "v1"})
    assert rank.state.status()["failures"] == {}  # refused before it reached the rank's loop
    with pytest.raises(WeightSyncError, match="expected a ray.ObjectRef"):
        rank.pull([object()], ["weight"], finalize={"weight_version": "v1"})
    # The pull failed: nothing was ended, the version did not move.
    assert rank.port.version is None and rank.state.status()["updates"] == 0


def _wait_for(cond, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_the_next_updates_walk_of_the_model_runs_once_the_update_ended(rank):
    """After an update's end the next pull would walk the model (post-load
    may have replaced parameters); that walk runs at the loop's next safe
    point instead, on the loop's thread, and finds the same parameters."""
    walks = []
    named = rank.port.named_parameters
    rank.port.named_parameters = lambda: (walks.append(threading.get_ident()) or named())
    recv = rank.receiver
    recv._plans.param_names()  # the first walk (a pull's)
    assert walks == [threading.get_ident()]
    rank.begin()
    rank.finalize(weight_version="v1")  # the session's end: post-load ran
    _wait_for(lambda: not recv.needs_refresh())
    assert walks[1:] == [rank.loop._thread.ident]
    assert recv.refresh() is False  # nothing left to do for the next pull
    assert len(walks) == 2


def test_an_update_ended_in_a_lane_pull_walks_after_its_answer_left(rank, monkeypatch):
    """A pull that ends the update (finalize=) must answer first: the walk
    is posted once the lane sent the answer, not while it is on its way."""
    from sglang.srt.ray.rdt.transport import sglang_ipc

    # open_lane says which Ray node the rank is on; no Ray here (asking would
    # start a local one in the test process, which later fixtures then meet).
    monkeypatch.setattr(sglang_ipc, "reach", lambda: {"node_id": "test-node", "gpus": []})
    recv = rank.receiver
    recv._plans.param_names()
    order = []

    def pull(refs, names, timeout, finalize):
        # what RankWeightSync.pull does for a folded finalize, minus the bytes
        rank._folding = True
        try:
            rank.on_scheduler(lambda: (recv.end_of_update(), rank.lane.end_of_update(),
                                       rank._update_ended()))
        finally:
            rank._folding = False
        order.append(("answered", recv.needs_refresh()))
        return {"ok": True}

    info = rank.open_lane("trainer-x", pull=pull)
    from sglang.srt.ray.rdt.trainer.lane import RankLink

    ref = type("Ref", (), {"hex": lambda self: "ef" * 20})()
    rank.lane._held["trainer-x"] = {ref.hex(): ref}
    link = RankLink(info["address"], info["secret"], info["pid"])
    try:
        assert link.send("pull_weights", {"ref_ids": [ref.hex()], "names": ["weight"]}).result(10) == {"ok": True}
    finally:
        link.close()
    assert order == [("answered", True)]  # still to walk when the answer was built
    _wait_for(lambda: not recv.needs_refresh())


def _parked(sync) -> bool:
    return wait_until(lambda: sync.safe_point._parked, 5, interval=0.001,
                      what="the loop waiting at its safe point")


def test_a_quiet_loop_lends_pulls_to_the_callers_thread_but_never_the_updates_end(rank):
    ran = []

    def fake_pull(refs, names, timeout):
        ran.append(("pull", threading.get_ident()))
        return {"stages": {}, "timing": {}}

    rank.receiver.pull = fake_pull
    rank.port.post_load = lambda: ran.append(("post_load", threading.get_ident()))
    rank.port.is_paused = True
    me, loop = threading.get_ident(), rank.loop._thread.ident
    # Paused and idle: the loop waits, lending its safe point. (It goes round
    # every 0.5 ms; a call that comes between two waits goes to the loop.)
    for _ in range(50):
        assert _parked(rank)
        out = rank.pull([object()], ["weight"])
        if out["timing"].get("lent"):
            break
    assert ran[-1] == ("pull", me) and out["timing"]["lent"] is True
    assert rank.safe_point.lent == 1 and all(r in (("pull", me), ("pull", loop)) for r in ran)
    # With the update's end folded in (sglang's post-load): on the loop thread.
    ran.clear()
    assert _parked(rank)
    out = rank.pull([object()], ["weight"], finalize={"weight_version": "v2"})
    assert ran == [("pull", loop), ("post_load", loop)] and "lent" not in out["timing"]
    assert out["finalized"]["weight_version"] == "v2" and rank.safe_point.lent == 1
    # Lent or not, the quiescence check runs first: unpaused, a pull is refused.
    rank.port.is_paused = False
    with pytest.raises(WeightSyncError, match=NOT_PAUSED):
        rank.pull([object()], ["weight"])
    assert ran == [("pull", loop), ("post_load", loop)]  # refused before the receiver
