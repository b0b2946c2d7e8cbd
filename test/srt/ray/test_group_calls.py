"""Work every rank of a TP/PP group runs at the same loop point
(managers/scheduler_group_calls.py), and a TP 2 engine under churn.

* fast: :class:`GroupCalls` around a stand-in loop: a call is queued on the
  group's entry rank, taken with an iteration's requests and run there; the
  TP group's gathered outcomes make a failure on any rank the caller's error;
  a call nobody takes is withdrawn at its bound, one taken but stuck is
  reported, a non-entry rank refuses.
* slow: a real ``--tp-size 2`` CPU engine (sglang's own model code over gloo)
  with requests running all the time, through many rounds of good updates
  (HTTP session and caller-paused client, whose end and abort are group
  calls), sessions aborted, leases left to expire and refused updates: every
  call answers within its bound, every answer is the greedy output of one
  complete checkpoint, and the last good one is served after.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import wait_until
from sglang.srt.managers.scheduler_group_calls import GroupCall, GroupCallError, GroupCalls


class Loop:
    """Iterations of a rank's loop: take the calls, run them (as the dispatcher)."""

    def __init__(self, calls: GroupCalls):
        self.calls, self.stop = calls, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            for call in self.calls.take():
                self.calls.run(call)
            time.sleep(0.001)


def test_a_group_call_runs_at_the_loop_and_returns_the_entry_ranks_result():
    ran = []
    calls = GroupCalls(lambda op, args: ran.append((op, args, threading.current_thread().name)) or "done",
                       entry=True, gather=lambda o: [o, (True, "other rank ok")])
    loop = Loop(calls)
    loop.thread.start()
    try:
        assert calls.call("finalize", ("v1", True), 30) == "done"
        assert ran == [("finalize", ("v1", True), loop.thread.name)] and calls.calls_run == 1
    finally:
        loop.stop.set()


def test_a_failure_on_another_rank_is_the_callers_error_naming_it():
    calls = GroupCalls(lambda op, args: "fine here", entry=True,
                       gather=lambda o: [o, (False, "WeightSyncError: the update ended inconsistent")])
    loop = Loop(calls)
    loop.thread.start()
    try:
        with pytest.raises(GroupCallError, match="TP rank 1: WeightSyncError: the update ended inconsistent"):
            calls.call("finalize", (), 30)
    finally:
        loop.stop.set()


def test_the_entry_ranks_own_error_keeps_its_type():
    def fail(op, args):
        raise KeyError("no such op")

    calls = GroupCalls(fail, entry=True, gather=lambda o: [o, (True, None)])
    loop = Loop(calls)
    loop.thread.start()
    try:
        with pytest.raises(KeyError, match="no such op"):
            calls.call("abort", (), 30)
    finally:
        loop.stop.set()


def test_a_call_no_loop_takes_is_withdrawn_at_its_bound_and_nothing_runs():
    calls = GroupCalls(lambda op, args: "ran", entry=True)
    with pytest.raises(TimeoutError, match="nothing was changed"):
        calls.call("begin", (), 0.01)
    assert calls.take() == [] and calls.calls_run == 0


def test_a_stopped_loop_and_a_non_entry_rank_refuse_at_once():
    with pytest.raises(GroupCallError, match="loop is stopped"):
        GroupCalls(lambda op, args: None, entry=True, loop_state=lambda: "stopped").call("begin", (), 30)
    with pytest.raises(GroupCallError, match="entry rank"):
        GroupCalls(lambda op, args: None, entry=False).call("begin", (), 30)


def test_a_call_taken_by_a_loop_that_then_stops_is_reported():
    state = {"loop": "running"}
    calls = GroupCalls(lambda op, args: None, entry=True, loop_state=lambda: state["loop"])

    def take_and_stop():
        wait_until(lambda: calls._queued, 30, 0.001, "the call to be queued")
        assert [c.op for c in calls.take()] == ["end"]  # taken, never run
        state["loop"] = "stopped"

    t = threading.Thread(target=take_and_stop)
    t.start()
    with pytest.raises(GroupCallError, match="taken by the scheduler loop but did not finish"):
        calls.call("end", (), 30)
    t.join()


def test_a_group_call_is_picklable_as_the_broadcast_needs():
    import pickle

    call = GroupCall(7, "finalize", ("v3", True))
    assert pickle.loads(pickle.dumps(call)) == call


# --------------------------------------------------------------------------- #
# A TP 2 engine under churn
# --------------------------------------------------------------------------- #
PROMPTS = ["the quick brown fox", "a b c d e"]
N = 8
ROUNDS = 50


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    from tiny_model import build_tiny_model

    return [tiny_model, build_tiny_model(tmp_path_factory.mktemp("churn") / "m1", seed=1)]


@pytest.mark.slow
def test_tp2_engine_under_load_survives_rounds_of_updates_aborts_expiries_and_refusals(
        models, ray_head, ray_client, tp2_server):
    from sglang.srt.ray.rdt import WeightSyncClient
    from sglang.srt.ray.rdt.errors import WeightSyncError
    from tiny_model import checkpoint_state_dict, hf_greedy

    server = tp2_server
    sds = [checkpoint_state_dict(m) for m in models]
    expected = [{p: hf_greedy(m, p, N) for p in PROMPTS} for m in models]
    assert all(expected[0][p] != expected[1][p] for p in PROMPTS)
    answers, errors, stop = [], [], threading.Event()

    def load(prompt):
        while not stop.is_set():
            try:
                answers.append((prompt, server.output_ids(prompt, N)))  # (bounded: 120 s)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(repr(e))

    http = WeightSyncClient.connect(port=server.port, namespace=ray_head.namespace, tp_size=2,
                                    bucket_bytes=64 * 1024, call_timeout_s=60)
    paused = WeightSyncClient([r.actor for r in http.ranks], names=[r.name for r in http.ranks],
                              bucket_bytes=64 * 1024, call_timeout_s=60)  # no url: the caller pauses
    clients = [http, paused]
    loaders = [threading.Thread(target=load, args=(p,), daemon=True) for p in PROMPTS]

    def post(path, body=None, ok=True):
        r = requests.post(f"{server.url}{path}", json=body or {}, timeout=120)
        assert (r.status_code == 200) is ok, (path, r.status_code, r.text)
        return r.json()

    def status():
        return requests.get(f"{server.url}/weight_sync/status", timeout=60).json()

    served, kinds = 0, []
    try:
        for c in clients:
            c.register()
        http.update(sds[0], version="start", layout="hf")  # (whatever an earlier module left served)
        for t in loaders:
            t.start()
        for i in range(ROUNDS):
            kind = ("http", "paused", "abort", "expire", "refused")[i % 5]
            kinds.append(kind)
            if kind == "http":
                served = 1 - served
                http.update(sds[served], version=f"v{i}", layout="hf", strict=True)
            elif kind == "paused":
                served = 1 - served
                # abort: requests in flight end now, with what they had (a
                # retracted or paused-in-place request would go on under the
                # new weights: a legitimate mix of two complete checkpoints)
                post("/pause_generation", {"mode": "abort"})
                paused.update(http.hf_resharder().reshard(sds[served]), version=f"v{i}")
                post("/continue_generation")
            elif kind == "abort":
                sid = post("/weight_sync/begin", {"lease_s": 60})["session_id"]
                post("/weight_sync/abort", {"reason": "churn", "session_id": sid})
            elif kind == "expire":
                post("/weight_sync/begin", {"lease_s": 1})
                wait_until(lambda: not status()["update_open"], 60, 0.05, "the lease to expire")
            else:
                bad = dict(sds[1 - served])
                name = "model.layers.0.mlp.up_proj.weight"
                bad[name] = bad[name][:, :-1]
                with pytest.raises(WeightSyncError, match=f"'{name}': shape"):
                    http.update(bad, version="never", layout="hf")
            assert requests.get(f"{server.url}/health", timeout=60).status_code == 200, (i, kind)
        st = status()
        assert st["weights_consistent"] and not st["update_open"], st
        assert st["weight_version"] == f"v{max(i for i, k in enumerate(kinds) if k in ('http', 'paused'))}"
        for p in PROMPTS:  # the last good update is what is served
            assert server.output_ids(p, N) == expected[served][p]
    finally:
        stop.set()
        for t in loaders:
            if t.ident is not None:
                t.join(timeout=180)
        for c in clients:
            c.close()
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in loaders), "a request never answered"
    assert len(answers) >= ROUNDS, len(answers)  # requests ran all along
    # every answer from one complete checkpoint (one aborted by the pause: a prefix of it)
    torn = [(p, ids) for p, ids in answers if not any(ids == e[p][:len(ids)] for e in expected)]
    assert not torn, torn[:3]
    assert sum(ids in (expected[0][p], expected[1][p]) for p, ids in answers) >= ROUNDS
