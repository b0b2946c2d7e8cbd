"""Run work on the scheduler's own thread, between two iterations of its loop.

Ray calls actor methods (``pull_weights``, ``finalize_weight_update``) on
threads of their own while ``run_event_loop`` holds the scheduler's thread.
Touching scheduler state or parameters from those threads would race with a
forward pass. Instead they submit a task here; the event loop runs it right
after it has taken in new requests (``Scheduler.ingest_requests``) and before
it picks the next batch, so no batch is in flight on this rank's thread while
the task runs, and the task sees scheduler state as the loop does.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional


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
        while True:
            try:
                fn, fut = self._tasks.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up waiting
            try:
                fut.set_result(fn(scheduler))
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._tasks.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    # Caller side ------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    def call(self, scheduler, fn: Callable[[Any], Any], timeout_s: float) -> Any:
        """Run ``fn(scheduler)`` on the scheduler thread; wait at most ``timeout_s``.

        Before the event loop starts, nothing else touches the scheduler, so the
        task runs inline. After it stopped, the call is refused.
        """
        if self._state == "stopped":
            raise EventLoopNotRunning(
                "the scheduler event loop is not running (engine shut down)"
            )
        if self._state == "not_started":
            with self._inline_lock:
                if self._state == "not_started":
                    return fn(scheduler)
        if threading.get_ident() == self._loop_thread:
            return fn(scheduler)
        fut: Future = Future()
        self._tasks.put((fn, fut))
        self._wake()
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            if fut.cancel():
                raise TimeoutError(
                    f"the scheduler did not reach a safe point within {timeout_s:.0f} s "
                    "(a long batch, or the event loop is stuck); nothing was changed"
                ) from None
            # It started just now: wait for it to finish rather than leave it
            # running behind the caller's back.
            return fut.result()


def run_safe_point_tasks(scheduler) -> None:
    """Called by the scheduler loop once per iteration (see the patch)."""
    tasks = getattr(scheduler, "safe_point_tasks", None)
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
