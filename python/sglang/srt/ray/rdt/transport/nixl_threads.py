"""This process's Ray NIXL agent, with its busy progress thread at idle priority.

NIXL's UCX progress thread polls with a delay of 0 (Ray sets none), keeping a core busy for the process's life;
at ``SCHED_IDLE`` it does not slow transfers (progressed by the threads that wait on them). A trainer that puts
with ``_tensor_transport="nixl"`` calls :func:`start_nixl_agent` once, before its first put.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Dict, Set

from sglang.srt.ray.rdt.transport import compat
from sglang.srt.ray.rdt.transport.cma import proc_stat_fields

logger = logging.getLogger(__name__)

# How long new threads are watched, and the share of a core that counts as spinning.
WATCH_S = 0.1
SPINNING_SHARE = 0.5

_lock = threading.Lock()  # the agent is started once per process
_started = False
_idled = 0


def start_nixl_agent() -> int:
    """Build this process's Ray NIXL agent (once) and idle the threads it started that spin; return how many."""
    global _started, _idled
    if _started:
        return _idled
    with _lock:
        if _started:
            return _idled
        _started = True
        before = _threads()
        compat.transport_manager("NIXL").get_nixl_agent()
        new = _threads() - before
        for tid in _spinning(new) if new else ():
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                _idled += 1
            except OSError as e:  # the thread ended, or the policy is refused here
                logger.info("[RDT] NIXL progress thread %d keeps its priority: %s", tid, e)
        if _idled:
            logger.info("[RDT] NIXL's progress thread polls without sleeping; it runs at idle "
                        "priority in this process (%d thread(s))", _idled)
        return _idled


def _threads() -> Set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # no /proc: nothing to watch
        return set()


def _runnable_ns(tid: int) -> int:
    """Nanoseconds ``tid`` was runnable, on a CPU or waiting for one (CPU ticks where ``schedstat`` is missing)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) + int(waiting)
    except (OSError, ValueError):
        fields = proc_stat_fields(f"/proc/self/task/{tid}/stat")
        ticks = 0 if fields is None else int(fields[11]) + int(fields[12])  # utime, stime
        return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _spinning(tids: Set[int]) -> Set[int]:
    """The threads of ``tids`` runnable at least :data:`SPINNING_SHARE` of the :data:`WATCH_S` they were watched."""
    start: Dict[int, int] = {t: _runnable_ns(t) for t in tids}
    time.sleep(WATCH_S)
    return {t for t in tids if _runnable_ns(t) - start[t] >= SPINNING_SHARE * WATCH_S * 1e9}
