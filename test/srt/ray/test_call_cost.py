"""The fixed cost of one ``pull_weights`` call: what keeps it small, and its benchmark.

Fast tests (no Ray):

* the receiver plans a bucket layout once and reuses the plan while every
  target parameter keeps its storage and layout, walks the model again when
  one moved, and after an update's end keeps its plans only for the very same
  parameter objects — and the NIXL registrations follow a moved parameter;
* a paused scheduler loop waits at its safe point instead of spinning, runs a
  queued task at once, goes round at once for a request, and does not wait
  when it has lockstep peers (TP) or is not paused.

Against a live ``--backend ray --enable-rdt-weight-sync`` CPU server (one for
the module): ``benchmark/rdt_weight_sync/bench_call_cost.py`` runs briefly and
reports every stage; the paused engine's scheduler does not burn a core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import wait_until

from sglang.srt.managers.scheduler_safe_point import (
    IDLE_WAIT_S,
    SafePointQueue,
    run_safe_point_tasks,
)
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError
from sglang.srt.ray.rdt.engine.plan import TensorSpec
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.registration import RegistrationBook

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmark" / "rdt_weight_sync" / "bench_call_cost.py"


# --------------------------------------------------------------------------- #
# Receiver: plans reused while the targets stay where they were
# --------------------------------------------------------------------------- #
class Book:
    """Registration callbacks that remember what is registered."""

    def __init__(self):
        self.live = {}

    def register(self, t):
        self.live[t.untyped_storage().data_ptr()] = t

    def deregister(self, t):
        self.live.pop(t.untyped_storage().data_ptr())


def _receiver(model):
    book = Book()
    recv = RdtWeightReceiver(
        lambda: dict(model.named_parameters()),
        registrations=RegistrationBook(book.register, book.deregister),
    )
    assert recv.register()["registered"] is True
    return recv, book


def _specs(model, names):
    params = dict(model.named_parameters())
    return [[TensorSpec(tuple(params[n].shape), params[n].dtype) for n in names]]


def _plan(recv, specs, names):
    """What a pull does before anything moves: plan, then registrations."""
    plan, walked, reused = recv._plans.plan(specs, [names])
    recv._registration.sync_for_pull(plan.targets, walked, reused)
    return plan.targets[0], walked, reused


def test_a_layout_seen_before_reuses_its_plan_until_a_target_moves():
    model = torch.nn.Linear(8, 4)
    recv, book = _receiver(model)
    names = ["weight", "bias"]
    specs = _specs(model, names)
    first, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (True, False)
    assert [t.data_ptr() for t in first] == [model.weight.data_ptr(), model.bias.data_ptr()]
    again, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (False, True) and again is first
    # Another layout is planned against the same walk.
    only_bias, walked, reused = _plan(recv, _specs(model, ["bias"]), ["bias"])
    assert (walked, reused) == (False, False)

    # Post-load processing gives a parameter new storage: the plan notices,
    # the model is walked again and NIXL registers the new storage.
    old_ptr = model.weight.data_ptr()
    model.weight.data = model.weight.data.clone()
    moved, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (True, False)
    assert moved[0].data_ptr() == model.weight.data_ptr() != old_ptr
    assert model.weight.data_ptr() in book.live and old_ptr not in book.live


def test_a_re_viewed_parameter_is_checked_again_not_written_blindly():
    model = torch.nn.Linear(4, 4).requires_grad_(False)  # as served models are
    recv, _ = _receiver(model)
    specs = _specs(model, ["weight"])
    _plan(recv, specs, ["weight"])
    # Same storage, same address, same shape: another dtype...
    model.weight.data = model.weight.data.view(torch.int32)
    with pytest.raises(WeightSyncError, match="layout mismatch for 'weight'"):
        _plan(recv, specs, ["weight"])
    # ... or a transposed (non-contiguous) view of it.
    model.weight.data = model.weight.data.view(torch.float32).t()
    with pytest.raises(WeightSyncError, match="not contiguous"):
        _plan(recv, specs, ["weight"])


def test_after_an_update_plans_survive_only_for_the_same_parameter_objects():
    model = torch.nn.Linear(4, 4)
    recv, _ = _receiver(model)
    names = ["weight", "bias"]
    specs = _specs(model, names)
    _plan(recv, specs, names)
    recv.end_of_update()  # post-load processing ran: walk again
    _, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (True, True)  # nothing was replaced

    model.bias = torch.nn.Parameter(torch.zeros(4))  # a replaced parameter object
    recv.end_of_update()
    targets, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (True, False)
    assert targets[1].data_ptr() == model.bias.data_ptr()

    # sglang's own loads (update_weights_from_disk/tensor/...) may replace a
    # parameter object too: the plan kept the old one alive, so only the walk
    # their listener event asks for can tell.
    _plan(recv, specs, names)
    model.weight = torch.nn.Parameter(torch.zeros(4, 4))
    _, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (False, True)  # the old object still looks live
    recv.on_weights_loaded()
    targets, walked, reused = _plan(recv, specs, names)
    assert (walked, reused) == (True, False)
    assert targets[0].data_ptr() == model.weight.data_ptr()

    # Release/resume (memory saver) and a new registration drop the plans.
    for event in (recv.on_weights_released, recv.on_weights_resumed, recv.register):
        _plan(recv, specs, names)
        event()
        _, walked, reused = _plan(recv, specs, names)
        assert (walked, reused) == (True, False), event


class _IpcRef:
    """Stands for an SGLANG_IPC ref of GPU tensors (its specs already read)."""

    def __init__(self, hex_id):
        self._hex = hex_id

    def hex(self):
        return self._hex


@pytest.fixture
def ipc_pulls(monkeypatch):
    """A receiver whose refs read "over CUDA IPC": the fake copy writes 7s into
    the targets, then runs what the receiver asks to run during the copy."""
    from sglang.srt.ray.rdt.engine import receiver as receiver_mod
    from sglang.srt.ray.rdt.engine.update_state import Writer

    model = torch.nn.Linear(4, 4).requires_grad_(False)
    recv, _ = _receiver(model)
    events, serve = [], {"same_node": True}

    def fetch(ref, targets, copy=True, while_copying=None, meta=None, direct=None):
        if not serve["same_node"]:
            return None  # this path cannot read it here; nothing written
        events.append("launch")
        for t in targets:
            t.fill_(7.0)
        if while_copying is not None:
            events.append("check")
            while_copying(True)
        return list(targets)

    monkeypatch.setattr(receiver_mod, "cuda_ipc_ref", lambda ref, meta=None, direct=None: True)
    monkeypatch.setattr(receiver_mod, "fetch_same_node", fetch)
    monkeypatch.setattr(receiver_mod, "nixl_job", lambda ref, targets, meta=None, direct=None: None)
    monkeypatch.setattr(receiver_mod, "ref_writer", lambda ref, meta=None: Writer("trainer", "trainer"))
    monkeypatch.setattr(receiver_mod, "transport_used", lambda ref, meta=None: "cuda_ipc")
    names = ["weight", "bias"]

    def pull():
        ref = _IpcRef("ab" * 20)
        recv._ref_specs[ref.hex()] = _specs(model, names)[0]
        events.clear()
        return recv.pull([ref], names)

    return types.SimpleNamespace(model=model, recv=recv, events=events, serve=serve, pull=pull)


def test_over_cuda_ipc_a_reused_plan_is_checked_while_the_copy_runs(ipc_pulls):
    p = ipc_pulls
    assert p.pull()["plan_reused"] is False and p.events == ["launch"]  # checked by planning
    assert p.pull()["plan_reused"] is True and p.events == ["launch", "check"]
    assert torch.equal(p.model.bias, torch.full((4,), 7.0))

    # A parameter re-viewed behind the rank core's back (no update's end, no
    # sglang load): the copy already went into the planned storage, so the
    # pull fails and the rank says it is inconsistent.
    p.model.weight.data = p.model.weight.data.t()
    with pytest.raises(WeightsInconsistentError, match="changed since this layout was planned"):
        p.pull()
    assert p.events == ["launch", "check"]
    assert p.recv.state.consistent is False
    # Planned afresh: the re-viewed parameter is refused before anything moves.
    with pytest.raises(WeightSyncError, match="not contiguous"):
        p.pull()
    assert p.events == []
    p.model.weight.data = p.model.weight.data.contiguous()
    assert p.pull()["plan_reused"] is False
    p.recv.state.end()
    assert p.recv.state.consistent is True  # a complete update landed


def test_a_parameter_post_load_moved_is_planned_afresh_not_written_into(ipc_pulls):
    """Post-load processing may give a parameter new storage (same object):
    the walk after the update's end checks the plans — ahead of the next
    update, or in its first pull — so the copy goes to the new storage."""
    p = ipc_pulls
    p.pull()
    for ahead in (False, True):
        p.recv.end_of_update()  # post-load ran ...
        p.model.weight.data = p.model.weight.data.clone()  # ... and moved the weight's storage
        if ahead:
            assert p.recv.refresh() is True  # at the loop's safe point, once the answer left
        out = p.pull()
        assert out["plan_reused"] is False and p.events == ["launch"], ahead
        assert torch.equal(p.model.weight, torch.full((4, 4), 7.0))
        assert p.recv.state.consistent is True


def test_a_moved_plan_found_before_another_path_writes_writes_nothing(ipc_pulls):
    p = ipc_pulls
    p.pull()
    p.serve["same_node"] = False  # e.g. the mapping was refused: Ray's fetch would read it
    p.model.weight.data = p.model.weight.data.clone()  # same layout, new storage
    before = p.model.weight.data.clone()
    with pytest.raises(WeightSyncError, match="changed since this layout was planned.*nothing was "
                       "written") as e:
        p.pull()
    assert not isinstance(e.value, WeightsInconsistentError)
    assert torch.equal(p.model.weight.data, before) and p.recv.state.consistent is True


# --------------------------------------------------------------------------- #
# Safe point: a quiet loop waits instead of spinning
# --------------------------------------------------------------------------- #
@pytest.fixture
def quiet_loop(monkeypatch):
    """A scheduler stand-in with a real zmq request socket, run by a thread
    that calls the safe point as sglang's loop does, counting its rounds."""
    import zmq

    import sglang.srt.runtime_context as rc

    par = types.SimpleNamespace(tp_size=1, pp_size=1, attn_dp_enabled=False)
    monkeypatch.setattr(rc, "get_parallel", lambda: par)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://call-cost-loop")
    sender = ctx.socket(zmq.PUSH)
    sender.connect("inproc://call-cost-loop")
    q = SafePointQueue()
    q.lending = True  # whatever SGLANG_RDT_LEND_SAFE_POINT says here
    sched = types.SimpleNamespace(
        safe_point_tasks=q, _engine_paused=True, _deferred_input_requests=[],
        gracefully_exit=False,
        request_receiver=types.SimpleNamespace(
            recv_from_tokenizer=sock, recv_from_rpc=None, recv_skipper=None,
            input_blocker=None, scripted_scheduler_hook=None),
    )
    q.loop_started()
    stop = threading.Event()
    rounds = []

    def loop():
        while not stop.is_set():
            try:
                sock.recv(zmq.NOBLOCK)  # what ingest_requests does
            except zmq.Again:
                pass
            run_safe_point_tasks(sched)
            rounds.append(time.monotonic())

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    yield types.SimpleNamespace(q=q, sched=sched, par=par, rounds=rounds, sender=sender,
                                thread=th)
    stop.set()
    th.join(5)
    sender.close(0)
    sock.close(0)
    ctx.term()


def _rounds_in(loop, seconds):
    n = len(loop.rounds)
    time.sleep(seconds)
    return len(loop.rounds) - n


def test_paused_loop_waits_and_wakes_at_once_for_a_task_or_a_request(quiet_loop):
    loop = quiet_loop
    assert _rounds_in(loop, 0.5) <= 0.5 / IDLE_WAIT_S + 3  # not spinning
    assert loop.q.idle_waits > 0
    # A task runs on the loop thread at once, not after the wait's time-out.
    t0 = time.monotonic()
    assert loop.q.call(loop.sched, lambda s: threading.get_ident(), 5) == loop.thread.ident
    assert time.monotonic() - t0 < IDLE_WAIT_S
    # Tasks keep being served from inside the wait.
    for _ in range(20):
        assert loop.q.call(loop.sched, lambda s: 1, 5) == 1
    # A request ends the wait: the loop goes round to take it in.
    time.sleep(0.01)
    n = len(loop.rounds)
    t0 = time.monotonic()
    loop.sender.send(b"request")
    while len(loop.rounds) == n and time.monotonic() - t0 < 5:
        time.sleep(0.0005)
    assert time.monotonic() - t0 < IDLE_WAIT_S


def test_serving_loop_does_not_wait_and_waits_again_once_paused(quiet_loop):
    loop = quiet_loop
    loop.sched._engine_paused = False  # serving (no weight-update session)
    time.sleep(2 * IDLE_WAIT_S)
    assert _rounds_in(loop, 0.2) > 200
    loop.sched._engine_paused = True
    time.sleep(2 * IDLE_WAIT_S)
    assert _rounds_in(loop, 0.5) <= 0.5 / IDLE_WAIT_S + 3


def _wait_parked(q) -> None:
    wait_until(lambda: q._parked, 5, interval=0.0005, what="the loop waiting at its safe point")


def _wait_new_idle_wait(q) -> None:
    """Until the loop began a wait after this call (one of IDLE_WAIT_S as patched)."""
    waits = q.idle_waits
    wait_until(lambda: q.idle_waits > waits, 5, interval=0.001, what="a new idle wait")
    _wait_parked(q)


def test_a_parked_loop_lends_its_safe_point_and_cannot_leave_while_a_lent_task_runs(quiet_loop):
    loop, me = quiet_loop, threading.get_ident()
    _wait_parked(loop.q)
    # Lent: the task runs here, with the loop's scheduler; not lent: on the loop.
    assert loop.q.call(None, lambda s: (threading.get_ident(), s), 5, lend=True) == (me, loop.sched)
    assert loop.q.lent == 1
    assert loop.q.call(loop.sched, lambda s: threading.get_ident(), 5) == loop.thread.ident
    # While a lent task runs, a request and a queued task wait for it: the
    # loop cannot leave its safe point beside the task.
    order, posted_ran = [], threading.Event()
    _wait_parked(loop.q)

    def lent_task(s):
        order.append("lent start")
        n = len(loop.rounds)
        loop.sender.send(b"request")  # would end the wait at once
        loop.q.post(lambda s: (order.append("posted"), posted_ran.set()))
        assert not posted_ran.wait(0.2)  # a window: the loop would take it within us
        assert len(loop.rounds) == n
        order.append("lent end")
        return "done"

    assert loop.q.call(None, lent_task, 5, lend=True) == "done"
    assert posted_ran.wait(5) and order == ["lent start", "lent end", "posted"]
    assert loop.q.lent == 2


def test_a_lent_task_that_ends_the_quiet_wakes_the_loop(quiet_loop, monkeypatch):
    import sglang.srt.managers.scheduler_safe_point as sp

    loop = quiet_loop
    monkeypatch.setattr(sp, "IDLE_WAIT_S", 30.0)  # without a wake-up it would sit 30 s
    _wait_new_idle_wait(loop.q)  # a wait that began after the patch: 30 s long

    def unpause(s):
        s._engine_paused = False  # serving again: the loop must go round
        return time.monotonic()

    t_done = loop.q.call(None, unpause, 5, lend=True)
    assert loop.q.lent == 1  # it ran here, not on the loop thread
    n = len(loop.rounds)
    wait_until(lambda: len(loop.rounds) > n, 10, interval=0.001,
               what="a round of the loop (it slept through the change)")
    assert loop.rounds[n] - t_done < 5


def test_a_lent_call_never_overtakes_a_queued_task_and_may_call_again(quiet_loop, monkeypatch):
    import sglang.srt.managers.scheduler_safe_point as sp

    loop, me = quiet_loop, threading.get_ident()
    monkeypatch.setattr(sp, "IDLE_WAIT_S", 30.0)
    _wait_new_idle_wait(loop.q)  # a 30 s wait began
    # A task in the queue whose wake-up has not come through yet: a lent call
    # goes behind it (and its own wake-up serves both), in order.
    from concurrent.futures import Future

    order, fut = [], Future()
    loop.q._tasks.put((lambda s: order.append(("queued", threading.get_ident())), fut, {}))
    loop.q.call(None, lambda s: order.append(("lend", threading.get_ident())), 5, lend=True)
    assert fut.done() and loop.q.lent == 0
    assert order == [("queued", loop.thread.ident), ("lend", loop.thread.ident)]
    # A lent task that calls the safe point again runs that call right here
    # (the loop is held for it; queueing would wait for itself).
    _wait_parked(loop.q)

    def nested(s):
        return loop.q.call(None, lambda s2: (threading.get_ident(), s2), 2)

    t0 = time.monotonic()
    assert loop.q.call(None, nested, 5, lend=True) == (me, loop.sched)
    assert loop.q.lent == 1 and time.monotonic() - t0 < 1


def test_a_busy_loop_lends_nothing(quiet_loop):
    loop = quiet_loop
    _wait_parked(loop.q)
    gate, inside = threading.Event(), threading.Event()
    holder = threading.Thread(
        target=loop.q.call, args=(None, lambda s: (inside.set(), gate.wait(5)), 10))
    holder.start()
    assert inside.wait(5) and not loop.q._parked  # the loop thread runs a task
    got = {}
    caller = threading.Thread(target=lambda: got.setdefault(
        "thread", loop.q.call(None, lambda s: threading.get_ident(), 10, lend=True)))
    caller.start()
    wait_until(lambda: loop.q._tasks.qsize() > 0, 5, interval=0.0005,
               what="the lend call queued behind the running task")
    gate.set()
    holder.join(5)
    caller.join(5)
    assert got["thread"] == loop.thread.ident and loop.q.lent == 0


def test_rank_with_tp_peers_never_waits(monkeypatch):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: types.SimpleNamespace(
        tp_size=2, pp_size=1, attn_dp_enabled=False))
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    q = SafePointQueue()
    sched = types.SimpleNamespace(
        safe_point_tasks=q, _engine_paused=True, _deferred_input_requests=[],
        request_receiver=types.SimpleNamespace(recv_from_tokenizer=sock, recv_from_rpc=None),
    )
    q.loop_started()
    t0 = time.monotonic()
    for _ in range(50):
        run_safe_point_tasks(sched)
    assert time.monotonic() - t0 < IDLE_WAIT_S and q.idle_waits == 0
    sock.close(0)
    ctx.term()


# --------------------------------------------------------------------------- #
# A live server: the benchmark, and a paused engine that sleeps
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def server(ray_head, tiny_model, tmp_path_factory):
    from conftest import start_server

    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace],
        tmp_path_factory.mktemp("call-cost-server"),
    )
    yield s
    s.terminate()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "SGLANG_IPC"])
def test_call_cost_bench_reports_every_stage_against_a_live_server(server, ray_head, tmp_path, transport):
    out = tmp_path / "bench_call_cost.json"
    env = {**os.environ, **ray_head.env}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--url", server.url, "--namespace", ray_head.namespace,
         "--calls", "8", "--warmup", "2", "--calls-per-update", "4", "--json-out", str(out),
         "--transport", transport],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT),
    )
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    res = json.loads(out.read_text())
    assert (res["calls"], res["tensors"], res["bytes"], res["transport"]) == (8, 1, 256, transport)
    assert res["updates"] == 2 and res["registered"] is True
    # Plans are reused within an update and across updates (same parameters).
    assert res["plan_reused"] == 1.0, res
    pull = res["pull"]
    for row in ("dispatch", "safe-point pickup", "quiesce check", "metadata", "plan",
                "registration", "admit", "set_target", "direct", "transfer", "verify", "record", "log",
                "safe-point handoff", "reply"):
        assert pull[row]["p50_ms"] >= 0, row
        assert row in proc.stdout, row
    # NIXL refs go through ray.get ("transfer"); same-node SGLANG_IPC refs are
    # read straight into the parameter ("direct": process_vm_readv here).
    moved = "transfer" if transport == "nixl" else "direct"
    assert pull[moved]["p50_ms"] > 0 and pull["total"]["p50_ms"] > 0
    assert res["noop"]["p50_ms"] > 0 and res["status_call"]["p50_ms"] > 0
    assert "pull p50 / no-op p50" in proc.stdout
    # The bench ended its updates cleanly and the engine serves again.
    assert server.output_ids("the quick brown fox", 4)


@pytest.mark.slow
def test_paused_engine_does_not_spin_a_core(server, ray_client, ray_head):
    import psutil
    import requests

    ray = ray_client
    (name,) = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
               if f"_port{server.port}_" in e["name"]]
    rank = ray.get_actor(name, namespace=ray_head.namespace)
    proc = psutil.Process(ray.get(rank.__ray_call__.remote(lambda self: os.getpid()), timeout=60))

    def cores_used(seconds=2.0):
        t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
        time.sleep(seconds)
        return (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)

    r = requests.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        time.sleep(0.5)
        paused = cores_used()
    finally:
        requests.post(f"{server.url}/continue_generation", json={}, timeout=60)
    # Spinning, sglang's loop and the Ray thread fighting it for the GIL
    # take about two cores; waiting at the safe point, a few percent of one.
    assert paused < 0.5, f"the paused rank used {paused:.2f} cores"
