"""Work queued from other threads runs on the scheduler loop's thread (managers/scheduler_safe_point.py).

Also: a quiet loop (paused, or in a weight-update session with nothing to
run) waits at its safe point instead of spinning, and a queued task or a
request ends the wait at once. Every assertion is about what ran, where and
in which order, and about the queue's counters — never about how long
something took, which a loaded machine cannot promise.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
from concurrent.futures import Future

import pytest

from conftest import wait_until

import sglang.srt.managers.scheduler_safe_point as sp
from sglang.srt.managers.scheduler_safe_point import (
    EventLoopNotRunning,
    SafePointQueue,
    attach_safe_point_queue,
    run_safe_point_tasks,
)

# A wait that no test outlives: whatever ends it early was a task or a request.
LONG_WAIT_S = 600.0


class FakeScheduler(types.SimpleNamespace):
    """A stand-in scheduler, hashed by identity like sglang's (the registry
    of safe-point queues and listeners holds schedulers weakly)."""

    __hash__ = object.__hash__


def scheduler_with(q, **attrs):
    sched = FakeScheduler(**attrs)
    if q is not None:
        attach_safe_point_queue(sched, q)
    return sched


@contextlib.contextmanager
def loop_running(sched):
    """A thread that runs ``sched``'s safe-point tasks as the scheduler's
    loop does (every millisecond) until the block ends; yields the thread."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            run_safe_point_tasks(sched)
            time.sleep(0.001)

    th = threading.Thread(target=loop)
    th.start()
    try:
        yield th
    finally:
        stop.set()
        th.join(10)


# --------------------------------------------------------------------------- #
# Safe points: work queued from other threads runs on the loop thread
# --------------------------------------------------------------------------- #
def test_safe_point_runs_tasks_on_the_loop_thread():
    q = SafePointQueue()
    sched = scheduler_with(q)
    q.loop_started()
    with loop_running(sched) as th:
        assert q.call(sched, lambda s: threading.get_ident(), 5) == th.ident
        with pytest.raises(KeyError):
            q.call(sched, lambda s: {}["missing"], 5)
    q.loop_stopped()
    with pytest.raises(EventLoopNotRunning, match="engine shut down"):
        q.call(sched, lambda s: 1, 1)


def test_posted_work_runs_at_the_next_safe_point_without_anyone_waiting(caplog):
    q = SafePointQueue()
    assert q.post(lambda s: 1) is False  # no loop runs to take it
    q.loop_started()
    ran = []
    gate = threading.Event()
    assert q.post(lambda s: ran.append((s, threading.get_ident()))) is True
    assert q.post(lambda s: {}["missing"]) is True  # a failure is logged, not raised
    assert q.post(lambda s: gate.set()) is True
    assert ran == []  # nothing ran on the poster's thread
    th = threading.Thread(target=q.run_pending, args=("sched",))
    with caplog.at_level("ERROR", logger="sglang.srt.managers.scheduler_safe_point"):
        th.start()
        th.join(5)
    assert gate.is_set() and ran == [("sched", th.ident)]
    assert "a task posted to the scheduler's safe point failed: KeyError('missing')" in caplog.text
    # Pending when the loop stops: dropped quietly (the engine is going away).
    q.post(lambda s: ran.append("late"))
    caplog.clear()
    q.loop_stopped()
    assert ran == [("sched", th.ident)] and "failed" not in caplog.text
    assert q.post(lambda s: 1) is False


def test_a_call_waiting_when_the_loop_stops_is_told_the_loop_stopped():
    q = SafePointQueue()
    q.loop_started()
    got = {}

    def caller():
        try:
            q.call(None, lambda s: "ran", 30)
        except EventLoopNotRunning as e:
            got["error"] = e

    th = threading.Thread(target=caller)
    th.start()
    wait_until(lambda: not q._tasks.empty(), 10, interval=0.001, what="the call queued")
    q.loop_stopped()
    th.join(10)
    assert isinstance(got.get("error"), EventLoopNotRunning)


def test_safe_point_times_out_without_running_the_task():
    q = SafePointQueue()
    q.loop_started()  # a loop that never reaches a safe point
    ran = []
    with pytest.raises(TimeoutError, match="nothing was changed"):
        q.call(None, lambda s: ran.append(1), 0.2)
    q.run_pending(None)  # the loop comes back later: the task was cancelled
    assert ran == []


def test_safe_point_runs_inline_before_the_loop_starts():
    q = SafePointQueue()
    assert q.call("sched", lambda s: s + "!", 1) == "sched!"


def test_tasks_run_in_the_order_they_were_queued_whoever_queued_them():
    q = SafePointQueue()
    q.loop_started()
    order = []
    for i in range(3):
        q.post(lambda s, i=i: order.append(("posted", i, threading.get_ident())))
    callers = []
    for i in range(3):  # calls from three threads, queued one after the other
        th = threading.Thread(target=q.call, args=(None, lambda s, i=i: order.append(
            ("called", i, threading.get_ident())), 30))
        th.start()
        wait_until(lambda: q._tasks.qsize() == 4 + i, 10, interval=0.001, what=f"call {i} queued")
        callers.append(th)
    loop = threading.Thread(target=q.run_pending, args=(None,))
    loop.start()
    loop.join(10)
    for th in callers:
        th.join(10)
    assert order == [("posted", 0, loop.ident), ("posted", 1, loop.ident), ("posted", 2, loop.ident),
                     ("called", 0, loop.ident), ("called", 1, loop.ident), ("called", 2, loop.ident)]


def test_a_task_that_calls_the_safe_point_again_runs_that_call_in_place():
    q = SafePointQueue()
    sched = scheduler_with(q)
    q.loop_started()
    with loop_running(sched) as th:
        # Queueing the inner call would wait for the task that queues it.
        nested = q.call(sched, lambda s: (threading.get_ident(), q.call(
            s, lambda s2: (threading.get_ident(), s2 is s), 30)), 30)
    assert nested == (th.ident, (th.ident, True))


# --------------------------------------------------------------------------- #
# --sleep-on-idle: sglang's idle sleeper wakes for a queued task
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("attach", [True, False])
def test_sleeping_idle_loop_wakes_for_a_queued_task(attach):
    """sglang's IdleSleeper blocks in a 1 s poll on the scheduler's sockets;
    with the queue's wake fd in that poll, a queued task ends the poll (it
    returns with an event); without it, the task waits for the poll to time
    out."""
    import zmq

    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
    from sglang.srt.managers.scheduler_safe_point import wake_idle_sleeper_on_tasks

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)  # a tokenizer socket nobody sends on
    sock.bind("inproc://idle-test")
    sleeper = IdleSleeper([sock])
    sched = scheduler_with(None, idle_sleeper=sleeper)
    q = SafePointQueue()
    attach_safe_point_queue(sched, q)
    if attach:
        assert wake_idle_sleeper_on_tasks(sched, q) is True
    assert wake_idle_sleeper_on_tasks(types.SimpleNamespace(), q) is False
    events = []  # what the loop did, in order
    poll = sleeper.poller.poll

    def watched_poll(timeout=None):
        events.append("poll")
        out = poll(timeout)
        events.append("woken" if out else "timed out")
        return out

    sleeper.poller.poll = watched_poll
    q.loop_started()
    stop = threading.Event()

    def loop():  # the scheduler's idle iterations: take in work, then sleep
        while not stop.is_set():
            run_safe_point_tasks(sched)
            sleeper.maybe_sleep()

    th = threading.Thread(target=loop)
    th.start()
    calls = 3 if attach else 1
    try:
        for _ in range(calls):
            wait_until(lambda: events and events[-1] == "poll", 30, interval=0.001,
                       what="the loop sleeping in its poll")
            assert q.call(sched, lambda s: events.append("task") or "ran", 30) == "ran"
    finally:
        stop.set()
        q.loop_stopped()
        if attach:
            q._wake()  # out of its poll now
        th.join(timeout=30)
        sock.close(0)
        ctx.term()
    assert not th.is_alive()
    ran = [i for i, e in enumerate(events) if e == "task"]
    assert len(ran) == calls
    # What ended the sleep before each task: the task itself, or the timeout.
    assert [events[i - 2: i] for i in ran] == [["poll", "woken" if attach else "timed out"]] * calls


# --------------------------------------------------------------------------- #
# A quiet loop waits at its safe point instead of spinning
# --------------------------------------------------------------------------- #
@pytest.fixture
def quiet_loop(request, monkeypatch):
    """A scheduler stand-in with a real zmq request socket, paused, run by a
    thread that calls the safe point as sglang's loop does; it counts its
    rounds and keeps the requests it took in. Parametrized indirectly with a
    wait length, the loop's idle waits last that long."""
    import zmq

    import sglang.srt.runtime_context as rc

    if getattr(request, "param", None) is not None:
        monkeypatch.setattr(sp, "IDLE_WAIT_S", request.param)
    par = types.SimpleNamespace(tp_size=1, pp_size=1, attn_dp_enabled=False)
    monkeypatch.setattr(rc, "get_parallel", lambda: par)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("inproc://safe-point-quiet-loop")
    sender = ctx.socket(zmq.PUSH)
    sender.connect("inproc://safe-point-quiet-loop")
    q = SafePointQueue()
    sched = scheduler_with(
        q, _engine_paused=True, _deferred_input_requests=[],
        gracefully_exit=False,
        request_receiver=types.SimpleNamespace(
            recv_from_tokenizer=sock, recv_from_rpc=None, recv_skipper=None,
            input_blocker=None, scripted_scheduler_hook=None),
    )
    q.loop_started()
    stop = threading.Event()
    rounds, requests = [0], []

    def loop():
        while not stop.is_set():
            try:
                requests.append(sock.recv(zmq.NOBLOCK))  # what ingest_requests does
            except zmq.Again:
                pass
            run_safe_point_tasks(sched)
            rounds[0] += 1

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    loop_ns = types.SimpleNamespace(q=q, sched=sched, sender=sender, thread=th, requests=requests,
                                    rounds=lambda: rounds[0])
    try:
        yield loop_ns
    finally:
        stop.set()
        sched._engine_paused = False
        sender.send(b"stop")  # ends a wait in progress
        th.join(30)
        alive = th.is_alive()
        sender.close(0)
        sock.close(0)
        ctx.term()
    assert not alive, "the loop did not stop"


def _counts(loop):
    return loop.rounds(), loop.q.idle_waits


def _waiting(loop, waits: int):
    """Until the loop began ``waits`` more idle waits."""
    w0 = loop.q.idle_waits
    wait_until(lambda: loop.q.idle_waits >= w0 + waits, 30, interval=0.001,
               what=f"{waits} more idle waits")
    return loop.q.idle_waits


def _in_long_wait(loop):
    """Until the loop (its waits as long as LONG_WAIT_S) is in its first wait."""
    wait_until(lambda: loop.q.idle_waits >= 1, 30, interval=0.001, what="the loop's first wait")
    assert loop.q.idle_waits == 1
    return 1


def test_paused_loop_waits_every_round_instead_of_spinning(quiet_loop):
    loop = quiet_loop
    _waiting(loop, 1)
    r0, w0 = _counts(loop)
    _waiting(loop, 10)
    r1, w1 = _counts(loop)
    # One wait per round: the loop goes round only when a wait ended.
    assert w1 - w0 >= 10 and abs((r1 - r0) - (w1 - w0)) <= 1, (r1 - r0, w1 - w0)


@pytest.mark.parametrize("quiet_loop", [LONG_WAIT_S], indirect=True)
def test_paused_loop_runs_a_task_inside_its_wait_and_waits_on(quiet_loop):
    loop = quiet_loop
    waits = _in_long_wait(loop)
    rounds = loop.rounds()
    # The wait lasts longer than the test: only the task's wake-up can run it.
    assert loop.q.call(loop.sched, lambda s: threading.get_ident(), 30) == loop.thread.ident
    for i in range(20):  # tasks keep being served from inside the same wait
        assert loop.q.call(loop.sched, lambda s, i=i: i, 30) == i
    assert _counts(loop) == (rounds, waits)


@pytest.mark.parametrize("quiet_loop", [LONG_WAIT_S], indirect=True)
def test_a_request_ends_the_wait_and_the_loop_takes_it_in(quiet_loop):
    loop = quiet_loop
    waits = _in_long_wait(loop)
    rounds = loop.rounds()
    loop.sender.send(b"request")
    wait_until(lambda: loop.requests == [b"request"], 30, interval=0.001,
               what="the loop taking the request in")
    # It went round once for it and is waiting again.
    wait_until(lambda: loop.q.idle_waits == waits + 1, 30, interval=0.001, what="the next wait")
    assert loop.rounds() == rounds + 1


@pytest.mark.parametrize("quiet_loop", [LONG_WAIT_S], indirect=True)
def test_a_task_that_ends_the_quiet_sends_the_loop_round(quiet_loop):
    loop = quiet_loop
    waits = _in_long_wait(loop)
    rounds = loop.rounds()

    def unpause(s):
        s._engine_paused = False  # serving again: the loop must go round
        return threading.get_ident()

    assert loop.q.call(loop.sched, unpause, 30) == loop.thread.ident
    wait_until(lambda: loop.rounds() > rounds + 100, 30, interval=0.001,
               what="the loop going round (it slept through the change)")
    assert loop.q.idle_waits == waits  # serving: no more waits


def test_serving_loop_does_not_wait_and_waits_again_once_paused(quiet_loop):
    loop = quiet_loop
    _waiting(loop, 1)
    loop.sched._engine_paused = False  # serving (no weight-update session)
    # A wait in progress ends; from the round after it, none begins.
    r = loop.rounds()
    wait_until(lambda: loop.rounds() >= r + 2, 30, interval=0.001, what="two rounds")
    w = loop.q.idle_waits
    r = loop.rounds()
    wait_until(lambda: loop.rounds() >= r + 1000, 60, interval=0.001, what="a thousand rounds")
    assert loop.q.idle_waits == w
    loop.sched._engine_paused = True
    _waiting(loop, 5)


def test_in_a_weight_update_session_the_loop_waits_only_while_nothing_runs(quiet_loop):
    loop = quiet_loop
    busy = [False]
    loop.sched.is_fully_idle = lambda: not busy[0]
    loop.sched.weight_updater = types.SimpleNamespace(_session=object())  # begin_weight_update
    loop.sched._engine_paused = False
    _waiting(loop, 3)  # a session, nothing running: waits
    busy[0] = True  # a batch runs (in_place pause, drain): the loop must go round
    r = loop.rounds()
    wait_until(lambda: loop.rounds() >= r + 2, 30, interval=0.001, what="two rounds")
    w, r = loop.q.idle_waits, loop.rounds()
    wait_until(lambda: loop.rounds() >= r + 1000, 60, interval=0.001, what="a thousand rounds")
    assert loop.q.idle_waits == w


@pytest.mark.parametrize("quiet_loop", [LONG_WAIT_S], indirect=True)
def test_a_call_never_overtakes_a_task_queued_before_it(quiet_loop):
    loop = quiet_loop
    _in_long_wait(loop)
    order, fut = [], Future()
    # Queued without its wake-up (as if the wake-up were still on its way),
    # then a call whose wake-up serves both, in order.
    loop.q._tasks.put((lambda s: order.append(("queued", threading.get_ident())), fut, {}))
    loop.q.call(None, lambda s: order.append(("called", threading.get_ident())), 30)
    assert fut.done() and order == [("queued", loop.thread.ident), ("called", loop.thread.ident)]


def test_rank_with_tp_peers_never_waits(monkeypatch):
    import zmq

    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_parallel", lambda: types.SimpleNamespace(
        tp_size=2, pp_size=1, attn_dp_enabled=False))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    q = SafePointQueue()
    sched = scheduler_with(
        q, _engine_paused=True, _deferred_input_requests=[],
        request_receiver=types.SimpleNamespace(recv_from_tokenizer=sock, recv_from_rpc=None),
    )
    q.loop_started()
    ran = []
    try:
        for i in range(50):
            q.post(lambda s, i=i: ran.append(i))
            run_safe_point_tasks(sched)
    finally:
        sock.close(0)
        ctx.term()
    assert ran == list(range(50)) and q.idle_waits == 0


def test_a_scheduler_the_queue_does_not_know_never_waits():
    q = SafePointQueue()
    q.loop_started()
    sched = types.SimpleNamespace(_engine_paused=True)  # no request receiver to poll
    for _ in range(20):
        q.run_pending(sched)
    assert q.idle_waits == 0
