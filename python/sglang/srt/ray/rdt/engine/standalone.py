"""The rank core around a plain PyTorch model, without sglang's scheduler.

:class:`ModelPort` is a :class:`~.scheduler_port.SchedulerPort` over an
``nn.Module`` with its own pause/session flags, and :class:`ServingLoop` a
thread that serves the safe-point queue between "iterations" the way sglang's
event loop does. With them, :class:`~.rank_sync.RankWeightSync` runs exactly
the SchedulerActor's pull path (hop to the loop thread, quiescence check,
plan, transfer, bookkeeping) in the GPU benchmark's rank and in test doubles.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch

from sglang.srt.managers.scheduler_safe_point import SafePointQueue
from sglang.srt.ray.rdt.engine.rank_sync import RankWeightSync


class ModelPort:
    """A model that serves nothing: pausing and the session are flags; the
    update's end calls ``post_load`` (if given)."""

    def __init__(self, model: torch.nn.Module, post_load: Optional[Callable[[], None]] = None):
        self.model = model
        self.post_load = post_load
        self.is_paused = False
        self.is_session_open = False
        self.version: Optional[str] = None
        self.flushes = 0
        self.sync: Optional[RankWeightSync] = None  # told when the session ends

    def named_parameters(self):
        return self.model.named_parameters()

    def session_open(self) -> bool:
        return self.is_session_open

    def paused(self) -> bool:
        return self.is_paused

    def idle(self) -> bool:
        return True

    def begin_session(self) -> None:
        self.is_session_open = True
        if self.sync is not None:
            self.sync.on_weight_update_begin()

    def end_session(self) -> Optional[str]:
        self.is_session_open = False
        self.run_post_load()
        return self.sync.on_weight_update_end() if self.sync is not None else None

    def run_post_load(self) -> None:
        if self.post_load is not None:
            self.post_load()

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    def record_weight_version(self, version: str) -> None:
        self.version = version

    def weight_version(self) -> Optional[str]:
        return self.version

    def stream(self):
        return None  # the loop thread queues nothing on a stream of its own


class ServingLoop:
    """A thread that runs queued safe-point tasks between iterations. While
    ``quiet()`` (sglang's loop: paused or in a weight-update session, nothing
    running) its idle wait is lent to callers the way sglang's is
    (:meth:`SafePointQueue.parked`)."""

    def __init__(self, queue: SafePointQueue, iteration_s: float = 0.0005,
                 quiet: Optional[Callable[[], bool]] = None):
        self.queue = queue
        self.iteration_s = iteration_s
        self.quiet = quiet or (lambda: False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-loop", daemon=True)

    def start(self) -> "ServingLoop":
        self.queue.loop_started()
        self._thread.start()
        return self

    def _run(self) -> None:
        import select

        wake = self.queue.wake_fd()  # readable when a task is queued
        try:
            while not self._stop.is_set():
                self.queue.run_pending(None)
                # An idle iteration of a real loop: poll for requests; like
                # sglang's idle wait, a queued task ends the wait at once.
                with (self.queue.parked(None, self.quiet) if self.quiet()
                      else contextlib.nullcontext()):
                    select.select([wake], [], [], self.iteration_s)
        finally:
            self.queue.loop_stopped()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def standalone_rank(model: torch.nn.Module, **kwargs) -> RankWeightSync:
    """A :class:`RankWeightSync` over ``model`` with its loop running
    (``.safe_point`` is the queue, ``.port`` the :class:`ModelPort`)."""
    queue = SafePointQueue()
    port = ModelPort(model)
    sync = RankWeightSync(port, queue, **kwargs)
    port.sync = sync
    sync.loop = ServingLoop(queue, quiet=lambda: port.paused() or port.session_open()).start()
    return sync
