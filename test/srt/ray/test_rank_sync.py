"""The rank core (rdt/engine/rank_sync.py) around a plain model: the same code a
SchedulerActor runs, driven through its scheduler-facing port
(sglang/test/rdt_standalone.py). Pulls here come from in-memory sources through
``pull_sources`` (the lane's entry, the same path as ``pull_weights`` after
the refs are turned into sources); pulls of real RDT refs are in
test_receiver_faults.py and the server tests."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from conftest import TRAINER, MemorySource, wait_until

from sglang.srt.ray.rdt.engine.rank_sync import NOT_PAUSED, RankStatus, failure_kind
from sglang.test.rdt_standalone import standalone_rank
from sglang.srt.ray.rdt.engine.update_state import Writer
from sglang.srt.ray.rdt.errors import (
    WeightsInconsistentError,
    WeightSyncError,
    WeightUpdateConflictError,
)
from sglang.srt.ray.rdt.transport import same_node

OTHER = Writer("process:b", "trainer process B")


def weights(value: float):
    return [torch.full((2, 4), value), torch.full((2,), value)]


NAMES = ["weight", "bias"]


@pytest.fixture
def rank():
    model = torch.nn.Linear(4, 2)
    sync = standalone_rank(model, rank="test", pull_timeout_s=5)
    sync.model = model
    post_loads = sync.post_loads = []
    sync.port.post_load = lambda: post_loads.append(threading.get_ident())
    yield sync
    sync.loop.stop()
    sync.shutdown()


def _after_queued_work(rank):
    """Returns once every task queued at the loop so far has run (the queue is FIFO)."""
    rank.on_scheduler(lambda: None)


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


def test_an_open_session_without_a_pause_refuses_pulls_naming_the_fix(rank):
    """/begin_weight_update alone: requests would run between two pulls and be
    answered from a partly written model, so the pull is refused (nothing read)."""
    rank.begin()
    src = MemorySource(weights(1.0))
    with pytest.raises(WeightSyncError, match="session is open but generation is not paused") as e:
        rank.pull_sources([src], NAMES)
    assert "POST /pause_generation" in str(e.value) and src.threads == []
    assert rank.state.status()["weights_consistent"] and not rank.state.wrote_weights
    rank.port.is_paused = True  # miles' order: the same session now takes the pull
    assert rank.pull_sources([src], NAMES)["tensors"] == 2


def test_generation_continued_in_the_middle_of_an_update_marks_the_weights_inconsistent(rank):
    rank.port.is_paused = True
    rank.begin()
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    rank.port.is_paused = False
    rank.on_scheduler(rank.on_generation_continued)  # /continue_generation before the end
    st = rank.status()
    assert not st.weights_consistent and "generation continued" in st.inconsistent_reason
    rank.port.is_paused = True
    rank.pull_sources([MemorySource(weights(2.0))], NAMES)
    assert rank.finalize("v2")["update"]["consistent"]  # a complete update ends it
    assert rank.status().weights_consistent


class _Group:
    """A stand-in for the group calls of a multi-rank group (one process)."""

    def __init__(self, entry):
        self.entry, self.calls = entry, []

    def call(self, op, args, timeout_s):
        self.calls.append(op)
        return self.handler(op, args)


def test_begin_finalize_abort_of_a_multi_rank_group_are_group_calls_from_its_first_rank(rank):
    group = rank.group = _Group(entry=True)
    group.handler = rank.group_op
    rank.port.is_paused = True
    assert rank.begin() == {"success": True} and rank.port.is_session_open
    rank.pull_sources([MemorySource(weights(3.0))], NAMES)
    assert rank.finalize("g1")["weight_version"] == "g1"
    rank.begin()
    assert rank.abort("gone")["inconsistent_reason"] is None  # nothing written: still consistent
    assert group.calls == ["begin", "finalize", "begin", "abort"]

    rank.group = _Group(entry=False)
    for call in (rank.begin, lambda: rank.finalize("v"), lambda: rank.abort("x")):
        with pytest.raises(WeightSyncError, match=r"call it on the group's first rank \(tp_rank 0"):
            call()
    assert rank.group.calls == [] and not rank.port.is_session_open
    assert rank.status().group_entry is False


def test_an_abort_through_sglangs_end_drops_the_update(rank):
    rank.port.is_paused = True
    rank.begin()
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    assert rank.on_scheduler(lambda: rank.port.end_session(abort="lease expired")) is None
    st = rank.status()
    assert not st.update_open and not st.weights_consistent and st.inconsistent_reason == "lease expired"
    assert st.failures == {"abort": 1} and rank.port.version is None


def test_a_busy_rank_refuses_even_when_paused(rank):
    rank.port.is_paused = True
    rank.port.idle = lambda: False
    src = MemorySource(weights(1.0))
    with pytest.raises(WeightSyncError, match="a batch is still running"):
        rank.pull_sources([src], NAMES)
    assert src.threads == []  # refused before the source was read


def test_a_pull_reads_on_the_loop_thread_and_opens_an_update_under_a_pause(rank):
    rank.port.is_paused = True
    src = MemorySource(weights(2.0))
    stats = rank.pull_sources([src], NAMES)
    assert stats["tensors"] == 2 and stats["bytes"] == 40 and stats["transport"] == "memory"
    assert src.threads == [rank.loop._thread.ident]
    assert torch.equal(rank.model.weight, weights(2.0)[0])
    progress = rank.state.in_progress()
    assert progress["kind"] == "paused" and progress["params_written"] == 2


def test_session_lifecycle_through_the_port(rank):
    assert rank.begin() == {"success": True}
    assert rank.port.is_session_open and rank.state.update_open
    out = rank.finalize(weight_version="v7")
    assert out["success"] and out["weight_version"] == "v7"
    assert out["flushed_cache"] is False and rank.port.flushes == 0  # nothing was written
    assert out["update"]["pulls"] == 0 and out["update"]["consistent"] is True
    assert not rank.port.is_session_open and not rank.state.update_open
    assert rank.post_loads == [rank.loop._thread.ident]  # the session's end: post-load ran
    st = rank.status()
    assert st.weights_consistent and st.weight_version == "v7" and st.updates == 1
    assert rank.stats()["last_update"]["weight_version"] == "v7"


def test_finalize_flushes_the_cache_only_when_asked_and_weights_were_written(rank):
    rank.port.is_paused = True  # (miles: /pause_generation, then /begin_weight_update)
    rank.begin()
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    out = rank.finalize("v1", flush_cache=False)
    assert out["flushed_cache"] is False and rank.port.flushes == 0
    rank.port.is_paused = True  # (miles: /pause_generation, then /begin_weight_update)
    rank.begin()
    rank.pull_sources([MemorySource(weights(2.0))], NAMES)
    out = rank.finalize("v2")
    assert out["flushed_cache"] is True and rank.port.flushes == 1
    assert out["update"]["flushed_cache"] is True and out["update"]["params_updated"] == 2


def test_finalize_without_a_version_keeps_the_current_one(rank):
    rank.begin()
    rank.finalize("v1")
    rank.begin()
    out = rank.finalize()
    assert out["weight_version"] == "v1" and rank.port.version == "v1"
    assert rank.status().updates == 2


def test_finalize_under_a_plain_pause_runs_post_load_itself(rank):
    rank.port.is_paused = True
    rank.pull_sources([MemorySource(weights(3.0))], NAMES)
    out = rank.finalize("v3")
    assert out["success"] and out["update"]["params_updated"] == 2 and out["flushed_cache"]
    assert rank.post_loads == [rank.loop._thread.ident]
    assert not rank.port.is_session_open and not rank.state.update_open


def test_finalize_without_pause_or_session_is_refused(rank):
    with pytest.raises(WeightSyncError, match="refusing to finalize while generation may run"):
        rank.finalize("v1")
    assert rank.port.version is None  # refused before the version moved
    assert rank.state.status()["updates"] == 0 and rank.post_loads == []


def test_finalize_of_a_broken_update_raises_its_reason_until_a_clean_update_ends(rank):
    rank.port.is_paused = True
    with pytest.raises(WeightsInconsistentError, match="failed mid-transfer"):
        rank.pull_sources([MemorySource(weights(4.0), fail_at=1)], NAMES)
    with pytest.raises(WeightSyncError, match=r"the update ended inconsistent: 2 parameters of a "
                                              r"transfer that broke in this update were not written"):
        rank.finalize("v4")
    st = rank.status()
    assert st.weights_consistent is False and st.failed_updates == 1
    assert st.failures == {"transfer": 1}  # the rank's own refusal is not a finalize failure
    rank.pull_sources([MemorySource(weights(5.0))], NAMES)
    assert rank.finalize("v5")["update"]["consistent"] is True
    assert rank.status().weights_consistent is True


def test_finalize_after_two_writers_raises_the_conflict(rank):
    rank.port.is_paused = True
    rank.pull_sources([MemorySource(weights(1.0), writer=TRAINER)], NAMES)
    with pytest.raises(WeightUpdateConflictError, match="'weight' was already written"):
        rank.pull_sources([MemorySource(weights(2.0), writer=OTHER)], NAMES)
    assert torch.equal(rank.model.weight, weights(1.0)[0])  # the second pull wrote nothing
    with pytest.raises(WeightSyncError, match="the update ended inconsistent: parameter 'weight'"):
        rank.finalize("v2")
    assert rank.status().failures == {"conflict": 1}


def test_a_finalize_that_breaks_is_counted_and_the_next_walk_still_queued(rank):
    def broken_post_load():
        raise RuntimeError("post-load processing failed")

    rank.port.is_paused = True
    rank.receiver.param_names()  # the first walk (a pull's)
    rank.port.post_load = broken_post_load
    with pytest.raises(RuntimeError, match="post-load processing failed"):
        rank.finalize("v1")
    assert rank.status().failures == {"finalize": 1}
    _after_queued_work(rank)
    assert not rank.receiver.needs_refresh()  # walked at the loop after the update's end


def test_abort_closes_the_session_without_a_version(rank):
    rank.begin()
    status = rank.abort("trainer died")
    assert not rank.port.is_session_open and not rank.state.update_open
    assert status["weights_consistent"]  # nothing was written
    assert rank.port.version is None and rank.post_loads == [rank.loop._thread.ident]


def test_abort_after_a_pull_leaves_the_weights_inconsistent(rank):
    rank.port.is_paused = True  # (miles: /pause_generation, then /begin_weight_update)
    rank.begin()
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    status = rank.abort("trainer died")
    assert status["weights_consistent"] is False and status["inconsistent_reason"] == "trainer died"
    assert status["failures"] == {"abort": 1} and rank.port.version is None


def test_abort_queues_the_next_updates_walk_like_an_end(rank):
    rank.port.is_paused = True  # (miles: /pause_generation, then /begin_weight_update)
    rank.begin()
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    rank.abort("trainer died")
    rank.safe_point.call(None, lambda _s: None, 30)  # the queue runs in order: the walk ran
    assert not rank.receiver.needs_refresh()


def test_a_pull_after_shutdown_is_refused(rank):
    rank.port.is_paused = True
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    rank.shutdown()
    src = MemorySource(weights(2.0))
    with pytest.raises(WeightSyncError, match="the engine is shut down; this rank accepts no more pulls"):
        rank.pull_sources([src], NAMES)
    assert src.threads == [] and rank.state.status()["failures"] == {"rejected": 1}
    assert torch.equal(rank.model.weight, weights(1.0)[0])


def test_layout_names_every_parameter(rank):
    layout = rank.parameter_layout()
    assert set(layout) == {"weight", "bias"}
    assert layout["weight"]["shape"] == [2, 4] and layout["weight"]["dtype"] == "float32"
    assert layout["weight"]["data_ptr"] == rank.model.weight.data_ptr()


# --------------------------------------------------------------------------- #
# The next update's walk of the model, after the update's end
# --------------------------------------------------------------------------- #
def _count_walks(rank):
    walks = []
    named = rank.port.named_parameters
    rank.port.named_parameters = lambda: (walks.append(threading.get_ident()) or named())
    rank.receiver.param_names()  # the first walk (a pull's)
    assert walks == [threading.get_ident()]
    return walks


def test_the_next_updates_walk_of_the_model_runs_once_the_update_ended(rank):
    """After an update's end the next pull would walk the model (post-load
    may have replaced parameters); that walk runs at the loop's next safe
    point instead, on the loop's thread, and finds the same parameters."""
    walks = _count_walks(rank)
    recv = rank.receiver
    rank.begin()
    rank.finalize(weight_version="v1")  # the session's end: post-load ran
    _after_queued_work(rank)
    assert not recv.needs_refresh()
    assert walks[1:] == [rank.loop._thread.ident]
    assert recv.refresh() is False  # nothing left to do for the next pull
    assert len(walks) == 2


def test_finalize_with_walk_after_false_leaves_the_walk_to_its_caller(rank):
    walks = _count_walks(rank)
    rank.begin()
    rank.finalize("v1", walk_after=False)
    _after_queued_work(rank)
    assert rank.receiver.needs_refresh() and len(walks) == 1  # nothing was queued
    rank.prepare_next_pull()  # what the lane runs once its answer has left
    _after_queued_work(rank)
    assert not rank.receiver.needs_refresh() and walks[1:] == [rank.loop._thread.ident]


def test_sglangs_end_weight_update_ends_the_update_with_a_flush_and_walks(rank):
    """miles ends an update with /end_weight_update: sglang's session end,
    whose listener ends the rank's update (flush, state) and queues the walk."""
    walks = _count_walks(rank)
    rank.port.is_paused = True
    rank.on_scheduler(rank.port.begin_session)
    rank.pull_sources([MemorySource(weights(6.0))], NAMES)
    assert rank.on_scheduler(rank.port.end_session) is None  # a clean update
    assert rank.port.flushes == 1 and rank.state.status()["updates"] == 1
    _after_queued_work(rank)
    assert not rank.receiver.needs_refresh() and walks[1:] == [rank.loop._thread.ident]


def test_an_update_ended_on_the_lane_walks_after_its_answer_left(rank, monkeypatch):
    """A lane's finalize answers first: the next update's walk is queued once
    the lane sent the answer, not while it is on its way."""
    from sglang.srt.ray.rdt.trainer.lane import RankLink

    # open_lane says which Ray node the rank is on; asking Ray would start a
    # local one in the test process, which later fixtures then meet.
    monkeypatch.setattr(same_node, "_node_id", "test-node")
    recv = rank.receiver
    recv.param_names()
    rank.port.is_paused = True
    at_answer = []
    finalize = rank.finalize

    def recording_finalize(*args, **kwargs):
        out = finalize(*args, **kwargs)
        at_answer.append((kwargs, recv.needs_refresh(), rank._refresh_posted))
        return out

    monkeypatch.setattr(rank, "finalize", recording_finalize)
    info = rank.open_lane("trainer-x", os.getpid())
    assert info["node_id"] == "test-node"
    link = RankLink(info["address"], info["secret"], info["pid"], "trainer-x")
    try:
        out = link.send("finalize", {"weight_version": "v9"}).result(10)
    finally:
        link.close()
    assert out["weight_version"] == "v9"
    # The answer was built with the walk still to do and not yet queued.
    assert at_answer == [({"walk_after": False}, True, False)]
    wait_until(lambda: not recv.needs_refresh(), 10, interval=0.005,
               what="the walk queued after the lane's answer")



# --------------------------------------------------------------------------- #
# get_weight_sync_status
# --------------------------------------------------------------------------- #
def test_status_reports_the_update_the_receiver_and_the_loop(rank, monkeypatch):
    st = rank.status()
    assert isinstance(st, RankStatus)
    assert set(st.as_dict()) == {f.name for f in dataclasses.fields(RankStatus)}
    assert (st.enabled, st.weights_consistent, st.update_open, st.update_in_progress) == (
        True, True, False, None)
    assert (st.pulls, st.tensors, st.bytes, st.last_pull, st.updates) == (0, 0, 0, None, 0)
    assert (st.registered, st.registrations, st.weights_released) == (False, 0, False)
    assert st.transports == ["NIXL"] and st.ipc_reach is None and st.device_uuid is None
    assert st.lane == {"open": False} and st.event_loop == "running"

    rank.port.is_paused = True
    rank.pull_sources([MemorySource(weights(1.0))], NAMES)
    st = rank.status()
    assert st.update_open and st.update_in_progress["kind"] == "paused"
    assert st.update_in_progress["params_written"] == 2 and st.update_in_progress["writers"] == 1
    assert (st.pulls, st.tensors, st.bytes) == (1, 2, 40) and st.last_pull["transport"] == "memory"

    rank.finalize("v2")
    st = rank.status()
    assert not st.update_open and st.updates == 1 and st.weight_version == "v2"
    assert st.last_update["weight_version"] == "v2" and st.last_update["params_updated"] == 2

    # A rank that reads same-node sources says where from; its lane, once open.
    monkeypatch.setattr(same_node, "_node_id", "test-node")
    monkeypatch.setattr(same_node, "reach", lambda: {"node_id": "test-node", "gpus": []})
    rank.transports.append("SGLANG_IPC")
    rank.open_lane("trainer-x", os.getpid())
    st = rank.status()
    assert st.ipc_reach == {"node_id": "test-node", "gpus": []}
    assert st.lane == {"open": True, "senders": 1, "calls": 0}

    rank.loop.stop()
    assert rank.status().event_loop == "stopped"
