"""Run work on the scheduler's own thread, between two iterations of its loop.

Ray calls actor methods (``pull_weights``, ``finalize_weight_update``) on
threads of their own while ``run_event_loop`` holds the scheduler's thread.
Touching scheduler state or parameters from those threads would race with a
forward pass. Instead they submit a task here; the event loop runs it right
after it has taken in new requests (``Scheduler.ingest_requests``) and before
it picks the next batch, so no batch is in flight on this rank's thread while
the task runs, and the task sees scheduler state as the loop does.

While generation is paused (or a weight-update session is open and nothing
runs), sglang's loop has nothing to do but it still spins: it polls its
sockets without blocking, round after round, holding the GIL most of the
time. The Ray threads of the actor then wait for the GIL (Python hands it
over only every ``sys.getswitchinterval()``, 5 ms) on every step of every
call, and the rank burns a core doing nothing (two, measured: Ray's main
thread spends the other fighting for the GIL). So at its safe point a loop
in that state *waits* instead: in a poll on its request sockets and on this
queue's wake pipe, for at most :data:`IDLE_WAIT_S`. A request wakes it at once
(the loop goes round and takes it in); a queued task is run at once, still at
this safe point, and the wait goes on (the caller then gets the GIL back
without a fight). Only a rank that takes its requests alone does this (no
tensor/pipeline peers and no DP attention, whose ranks go round in lockstep
with it through a broadcast).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

# The longest a quiet loop waits at its safe point before it goes round again
# (request time-outs are checked once a round).
IDLE_WAIT_S = 0.05


def weight_update_session_open(scheduler) -> bool:
    """Whether sglang's weight-update session (begin_weight_update) is open."""
    return getattr(getattr(scheduler, "weight_updater", None), "_session", None) is not None


class EventLoopNotRunning(RuntimeError):
    pass


class SafePointQueue:
    def __init__(self):
        self._tasks: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._state = "not_started"  # not_started | running | stopped
        self._inline_lock = threading.Lock()
        self._loop_thread: Optional[int] = None
        self._wake_r: Optional[int] = None  # see wake_fd()
        self._wake_w: Optional[int] = None
        # (zmq.Poller over the request sockets + wake pipe, [sockets]) for the
        # idle wait; None: not built yet; False: this loop must not wait.
        self._idle_poller: Any = None
        self.idle_waits = 0  # how many times the loop waited (status, tests)

    def wake_fd(self) -> int:
        """A file descriptor that becomes readable whenever a task is queued.

        A loop that sleeps while idle (``--sleep-on-idle``: the scheduler
        blocks in a poll on its sockets for up to a second) adds it to what it
        polls, so a queued task wakes it instead of waiting for the timeout.
        """
        with self._inline_lock:
            if self._wake_r is None:
                r, w = os.pipe()
                os.set_blocking(r, False)
                os.set_blocking(w, False)
                self._wake_r, self._wake_w = r, w
            return self._wake_r

    def _wake(self) -> None:
        w = self._wake_w
        if w is not None:
            try:
                os.write(w, b"\0")
            except (BlockingIOError, OSError):
                pass  # full: the loop is awake already; closed: it stopped

    def _drain_wake(self) -> None:
        r = self._wake_r
        if r is None:
            return
        try:
            while os.read(r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # Event-loop side ------------------------------------------------------
    def loop_started(self) -> None:
        self._state = "running"

    def loop_stopped(self) -> None:
        self._state = "stopped"
        self._fail_pending(EventLoopNotRunning("the scheduler event loop stopped"))

    def run_pending(self, scheduler) -> None:
        self._loop_thread = threading.get_ident()
        if self._state != "running":
            self._state = "running"
        # Before taking tasks: a task queued after this read writes again.
        self._drain_wake()
        self._run_queued(scheduler)
        if self._may_wait(scheduler):
            self._wait_for_work(scheduler)

    def _run_queued(self, scheduler) -> None:
        while True:
            try:
                fn, fut, stamps = self._tasks.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up waiting
            stamps["started"] = time.perf_counter()
            try:
                result = fn(scheduler)
            except BaseException as e:  # delivered to the caller
                stamps["finished"] = time.perf_counter()
                fut.set_exception(e)
            else:
                stamps["finished"] = time.perf_counter()
                fut.set_result(result)

    # Idle wait (see the module docstring) ----------------------------------
    def _may_wait(self, scheduler) -> bool:
        """Whether the loop has nothing to do until a request or a task comes."""
        if self._idle_poller is False or not self._tasks.empty():
            return False
        if getattr(scheduler, "gracefully_exit", False) or getattr(
            scheduler, "_deferred_input_requests", None
        ):
            return False
        try:
            if not getattr(scheduler, "_engine_paused", False):
                # Not paused: only inside an open weight-update session with
                # nothing running or waiting (a drain holds new requests).
                if not weight_update_session_open(scheduler) or not scheduler.is_fully_idle():
                    return False
            if self._poller_for(scheduler) is None:
                return False
        except Exception:  # a scheduler this module does not know: never wait
            self._idle_poller = False
            return False
        # Looked at after the wake pipe exists: a task queued from here on
        # also writes to it, so the poll cannot sleep through it.
        return self._tasks.empty()

    def _poller_for(self, scheduler):
        if self._idle_poller is None:
            self._idle_poller = _build_idle_poller(scheduler, self.wake_fd()) or False
        return self._idle_poller or None

    def _wait_for_work(self, scheduler) -> None:
        poller, sockets = self._idle_poller
        deadline = time.monotonic() + IDLE_WAIT_S
        self.idle_waits += 1
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0:
                return
            events = dict(poller.poll(max(1, int(remaining_ms))))  # the GIL is free meanwhile
            if not events:
                return  # time for a round of the loop
            if any(sock in events for sock in sockets):
                return  # a request: the loop takes it in
            # Woken by a queued task: run it here, at this safe point, and
            # wait on (the caller gets the GIL without a fight).
            self._drain_wake()
            self._run_queued(scheduler)
            if not self._may_wait(scheduler):
                return

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut, _ = self._tasks.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    # Caller side ------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def post(self, fn: Callable[[Any], Any]) -> bool:
        """Queue ``fn(scheduler)`` for the loop's next safe point without
        waiting for it: for work that must run on the scheduler thread but
        that nobody waits on (its result is dropped, an exception is logged).
        Returns False when no loop runs to take it (not started or stopped);
        work posted while the loop stops may be dropped without running."""
        if self._state != "running":
            return False
        fut: Future = Future()
        fut.add_done_callback(_log_posted_failure)
        self._tasks.put((fn, fut, {}))
        self._wake()
        return True

    def call(self, scheduler, fn: Callable[[Any], Any], timeout_s: float) -> Any:
        """Run ``fn(scheduler)`` on the scheduler thread; wait at most ``timeout_s``.

        Before the event loop starts, nothing else touches the scheduler, so the
        task runs inline. After it stopped, the call is refused.

        A result that is a dict with a ``"timing"`` dict gets the task's stamps
        added to it (``time.perf_counter()``: when it was queued, started on
        the scheduler thread, finished, and when the caller had it back), so a
        caller can tell the wait for the safe point from the work.
        """
        queued = time.perf_counter()
        if self._state == "stopped":
            raise EventLoopNotRunning(
                "the scheduler event loop is not running (engine shut down)"
            )
        if self._state == "not_started":
            with self._inline_lock:
                if self._state == "not_started":
                    return _stamped(fn(scheduler), {"queued": queued})
        if threading.get_ident() == self._loop_thread:  # already at the safe point
            return _stamped(fn(scheduler), {"queued": queued})
        fut: Future = Future()
        stamps = {"queued": queued}
        self._tasks.put((fn, fut, stamps))
        self._wake()
        try:
            result = fut.result(timeout=timeout_s)
        except FutureTimeout:
            if fut.cancel():
                raise TimeoutError(
                    f"the scheduler did not reach a safe point within {timeout_s:.0f} s "
                    "(a long batch, or the event loop is stuck); nothing was changed"
                ) from None
            # It started just now: wait for it to finish (its own bounds end
            # it) rather than leave it running behind the caller's back.
            try:
                result = fut.result(timeout=timeout_s)
            except FutureTimeout:
                raise TimeoutError(
                    f"work at the scheduler's safe point started but did not finish within "
                    f"{timeout_s:.0f} s more; it may still run") from None
        return _stamped(result, stamps)


def _log_posted_failure(fut: Future) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None and not isinstance(exc, EventLoopNotRunning):  # not: the loop stopped
        logger.error("a task posted to the scheduler's safe point failed: %r", exc)


def _stamped(result: Any, stamps: dict) -> Any:
    timing = result.get("timing") if isinstance(result, dict) else None
    if isinstance(timing, dict):
        timing.update(stamps)
        timing["resumed"] = time.perf_counter()
        timing.setdefault("started", timing.get("pull_start", stamps["queued"]))
        timing.setdefault("finished", timing["resumed"])
    return result


def _build_idle_poller(scheduler, wake_fd: int):
    """A poller over ``scheduler``'s request sockets and ``wake_fd``, or None
    when this loop must not block between rounds: it does not take requests
    itself, it has peers that go round in lockstep with it (TP, PP, DP
    attention), or its input is not plain zmq sockets."""
    import zmq

    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    if (
        getattr(par, "tp_size", 1) != 1
        or getattr(par, "pp_size", 1) != 1
        or getattr(par, "attn_dp_enabled", False)
    ):
        return None
    receiver = getattr(scheduler, "request_receiver", None)
    if receiver is None or any(
        getattr(receiver, extra, None) is not None
        for extra in ("recv_skipper", "input_blocker", "scripted_scheduler_hook")
    ):
        return None
    sockets = [getattr(receiver, "recv_from_tokenizer", None), getattr(receiver, "recv_from_rpc", None)]
    if not isinstance(sockets[0], zmq.Socket):
        return None  # not the rank that takes requests, or a non-zmq ingress
    sockets = [s for s in sockets if isinstance(s, zmq.Socket)]
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    poller.register(wake_fd, zmq.POLLIN)
    return poller, sockets


# Each scheduler's queue, held here (the scheduler object is not touched).
_QUEUES: "weakref.WeakKeyDictionary[Any, SafePointQueue]" = weakref.WeakKeyDictionary()


def attach_safe_point_queue(scheduler, tasks: SafePointQueue) -> None:
    """Have ``scheduler``'s loop run the tasks queued on ``tasks``."""
    _QUEUES[scheduler] = tasks


def safe_point_queue(scheduler) -> Optional[SafePointQueue]:
    return _QUEUES.get(scheduler)


def run_safe_point_tasks(scheduler) -> None:
    """Called by the scheduler loop once per iteration (see the patch)."""
    tasks = _QUEUES.get(scheduler)
    if tasks is not None:
        tasks.run_pending(scheduler)


def wake_idle_sleeper_on_tasks(scheduler, tasks: SafePointQueue) -> bool:
    """Make ``scheduler``'s idle sleeper (``--sleep-on-idle``) wake when a task
    is queued. Returns False when it has no sleeper or one that cannot poll
    extra file descriptors (tasks then wait for its timeout)."""
    poller = getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)
    if poller is None:
        return False
    import zmq

    poller.register(tasks.wake_fd(), zmq.POLLIN)
    return True
