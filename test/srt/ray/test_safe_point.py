"""Work queued from other threads runs on the scheduler loop's thread (managers/scheduler_safe_point.py)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from sglang.srt.managers.scheduler_safe_point import (
    EventLoopNotRunning,
    SafePointQueue,
    run_safe_point_tasks,
)


# --------------------------------------------------------------------------- #
# Safe points: work queued from other threads runs on the loop thread
# --------------------------------------------------------------------------- #
def test_safe_point_runs_tasks_on_the_loop_thread():
    q = SafePointQueue()
    sched = types.SimpleNamespace(safe_point_tasks=q)
    q.loop_started()
    stop = threading.Event()
    loop_thread = {}

    def loop():
        loop_thread["id"] = threading.get_ident()
        while not stop.is_set():
            run_safe_point_tasks(sched)
            time.sleep(0.001)

    th = threading.Thread(target=loop)
    th.start()
    try:
        assert q.call(sched, lambda s: threading.get_ident(), 5) == loop_thread["id"]
        with pytest.raises(KeyError):
            q.call(sched, lambda s: {}["missing"], 5)
    finally:
        stop.set()
        th.join()
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


@pytest.mark.parametrize("attach", [True, False])
def test_sleeping_idle_loop_wakes_for_a_queued_task(attach):
    """--sleep-on-idle: sglang's IdleSleeper blocks in a 1 s poll on the
    scheduler's sockets; a queued weight-sync task must wake it."""
    import zmq

    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
    from sglang.srt.managers.scheduler_safe_point import wake_idle_sleeper_on_tasks

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)  # a tokenizer socket nobody sends on
    sock.bind("inproc://idle-test")
    sched = types.SimpleNamespace(idle_sleeper=IdleSleeper([sock]))
    q = SafePointQueue()
    sched.safe_point_tasks = q
    if attach:
        assert wake_idle_sleeper_on_tasks(sched, q) is True
    assert wake_idle_sleeper_on_tasks(types.SimpleNamespace(), q) is False
    q.loop_started()
    stop = threading.Event()

    def loop():  # the scheduler's idle iterations: take in work, then sleep
        while not stop.is_set():
            run_safe_point_tasks(sched)
            sched.idle_sleeper.maybe_sleep()

    th = threading.Thread(target=loop)
    th.start()
    waits = []
    try:
        for _ in range(3):
            time.sleep(0.1)  # the loop is back in its poll
            t0 = time.monotonic()
            assert q.call(sched, lambda s: "ran", 5) == "ran"
            waits.append(time.monotonic() - t0)
    finally:
        stop.set()
        th.join(timeout=5)  # at most one more poll timeout
        sock.close(0)
        ctx.term()
    if attach:
        assert max(waits) < 0.3, waits
    else:  # without the wake fd every call waits for the poll timeout
        assert min(waits) > 0.5, waits
