"""Work that every rank of a tensor/pipeline-parallel group runs at the same point.

A weight update's begin and end run collectives (``begin_weight_update`` and
``end_weight_update`` end in a barrier on the TP group), and every iteration of
a multi-rank scheduler loop runs collectives of its own (the broadcast of the
requests rank 0 received, the forward pass). Work that one rank starts from
another thread at whatever point its loop happens to be (a Ray actor call on
its safe-point queue) can meet the other ranks inside a different collective
and deadlock the group. sglang's own control requests never do: rank 0
receives them and broadcasts them with the requests, so every rank handles
them in the same iteration, in the same order.

A :class:`GroupCall` travels the same way. The group's entry rank (TP rank 0
of pipeline stage 0) queues it (:meth:`GroupCalls.call`); its loop adds the
queued calls to what it broadcasts (``take_group_calls``, from
``Scheduler.ingest_requests``); every rank's request dispatcher runs it
(``run_group_call``), and the ranks of the TP group gather their outcomes, so
the caller learns of a failure on any of them. A pipeline stage after the
first gets the call with the requests relayed to it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

# How often a waiting caller looks whether the loop stopped.
STOP_CHECK_S = 0.5


@dataclass(frozen=True)
class GroupCall:
    """``op(*args)`` on every rank of the group (picklable: it is broadcast)."""

    call_id: int
    op: str
    args: Tuple[Any, ...] = ()


class GroupCallError(RuntimeError):
    """A group call failed on one or more ranks; the message names them."""


class GroupCalls:
    """One rank's side of group calls.

    Args:
        handler: ``handler(op, args)`` runs the call on this rank (on its
            scheduler thread) and returns a picklable result.
        entry: whether this rank is the group's entry (where calls start).
        gather: ``gather(outcome) -> [outcome of every rank]`` over the
            rank's TP group (None: a group of one).
        loop_state: ``loop_state()`` is "not_started", "running" or
            "stopped" (the safe-point queue's).
    """

    def __init__(self, handler: Callable[[str, tuple], Any], *, entry: bool,
                 gather: Optional[Callable[[Any], List[Any]]] = None,
                 loop_state: Callable[[], str] = lambda: "running", label: str = ""):
        self.handler, self.entry, self._gather = handler, entry, gather
        self._loop_state, self.label = loop_state, label
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _queued and _waiting
        self._queued: List[GroupCall] = []  # not yet taken by the loop
        self._waiting: Dict[int, Future] = {}  # call id -> the caller's future
        self.calls_run = 0

    # -- the entry rank's caller ---------------------------------------------- #
    def call(self, op: str, args: tuple, timeout_s: float) -> Any:
        """Run ``op`` on every rank of the group; wait at most ``timeout_s``
        for the loop to take it (a call taken is waited for until it ran: it
        runs in one iteration on every rank, bounded by the op's own limits)."""
        if not self.entry:
            raise GroupCallError("group calls start at the group's entry rank")
        state = self._loop_state()
        if state != "running":
            raise GroupCallError(f"the scheduler loop is {state.replace('_', ' ')}: "
                                 f"{op} cannot reach the other ranks now")
        call, fut = GroupCall(next(self._ids), op, tuple(args)), Future()
        with self._lock:
            self._queued.append(call)
            self._waiting[call.call_id] = fut
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=STOP_CHECK_S)
            except FutureTimeout:
                pass
            now = time.monotonic()
            with self._lock:
                if call in self._queued:
                    if now < deadline and self._loop_state() == "running":
                        continue
                    self._queued.remove(call)
                    self._waiting.pop(call.call_id, None)
                    raise TimeoutError(
                        f"the scheduler did not reach {op} within {timeout_s:.0f} s (a long batch, "
                        "or the loop is stuck or stopped); nothing was changed")
            # Taken: it runs in one iteration on every rank; a loop that
            # stopped, or a call still running a bound later, is reported.
            if self._loop_state() == "stopped" or now > deadline + timeout_s:
                with self._lock:
                    self._waiting.pop(call.call_id, None)
                raise GroupCallError(f"{op} was taken by the scheduler loop but did not finish "
                                     f"(loop {self._loop_state()}); the group may be stuck")

    # -- the loops --------------------------------------------------------------- #
    def take(self) -> List[GroupCall]:
        """The calls to broadcast with this iteration's requests (entry rank)."""
        if not self._queued:
            return []
        with self._lock:
            out, self._queued = self._queued, []
        return out

    def run(self, call: GroupCall) -> None:
        """Run ``call`` here (every rank, from the request dispatcher)."""
        self.calls_run += 1
        try:
            outcome = (True, self.handler(call.op, call.args))
        except BaseException as e:  # every rank still takes part in the gather
            outcome = (False, f"{type(e).__name__}: {e}", e)
        outcomes = self._gather(outcome[:2]) if self._gather is not None else [outcome[:2]]
        # (anything but an outcome: that rank met another collective, so the group is out of step)
        failed = [(rank, o[1] if isinstance(o, tuple) else f"out of step: {o!r}")
                  for rank, o in enumerate(outcomes) if not (isinstance(o, tuple) and o[0])]
        with self._lock:
            fut = self._waiting.pop(call.call_id, None)
        if fut is None:
            for rank, message in failed:
                logger.error("group call %s failed on TP rank %d%s: %s", call.op, rank,
                             f" ({self.label})" if self.label else "", message)
            return
        if not failed:
            fut.set_result(outcome[1])
        elif len(failed) == 1 and not outcome[0]:  # only here: the rank's own error
            fut.set_exception(outcome[2])
        else:
            fut.set_exception(GroupCallError("; ".join(
                f"TP rank {rank}: {message}" for rank, message in failed)))


# Each scheduler's group calls, held here (the scheduler object is not touched).
_GROUPS: "weakref.WeakKeyDictionary[Any, GroupCalls]" = weakref.WeakKeyDictionary()


def attach_group_calls(scheduler, calls: GroupCalls) -> None:
    _GROUPS[scheduler] = calls


def take_group_calls(scheduler) -> List[GroupCall]:
    """Called by the scheduler loop once per iteration (see the patch)."""
    calls = _GROUPS.get(scheduler)
    return calls.take() if calls is not None else []


def run_group_call(scheduler, call: GroupCall) -> None:
    """The request dispatcher's handler for :class:`GroupCall` (see the patch)."""
    calls = _GROUPS.get(scheduler)
    if calls is None:  # pragma: no cover - only broadcast by an attached rank 0
        logger.error("group call %s reached a rank without weight sync", call.op)
        return
    calls.run(call)


def gather_over(group) -> Callable[[Any], List[Any]]:
    """``gather(obj)``: every rank's ``obj`` over the torch.distributed ``group``."""
    import torch.distributed as dist

    size = dist.get_world_size(group)

    def gather(obj):
        out = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather
