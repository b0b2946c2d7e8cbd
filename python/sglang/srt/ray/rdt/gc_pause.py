"""Optionally keep Python's cyclic garbage collector out of a rank's weight update.

A full collection in a process that holds Ray, torch and a model stops it
for 75-107 ms (H200 host), longer than a whole colocated update. With
``SGLANG_RDT_PAUSE_GC=1`` (off by default: a library does not change its
host process's interpreter unless asked) a rank's update runs with automatic
collection off, from its first pull until the update ends, or, on a rank
that stays paused for the next update, until generation continues. A timer
turns collection back on after :data:`MAX_HOLD_S` whatever happens.
Reference counting still frees acyclic garbage. The trainer's collector is
never touched. Holders nest: the first one turns collection off (if it was
on), the last one turns it back on.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Dict, Optional, Set

# (imported here: a first import inside a rank's first pull cost it ~16 ms)
from sglang.srt.environ import envs

# A rank that stays paused longer than this between updates collects again.
MAX_HOLD_S = 300.0

_lock = threading.Lock()  # guards the holders, the timer and the collector's state
_holders: Dict[str, float] = {}  # holder -> when it began holding (monotonic)
_we_disabled = False
_timer: Optional[threading.Timer] = None  # ends a hold that outlived MAX_HOLD_S


def enabled() -> bool:
    return envs.SGLANG_RDT_PAUSE_GC.get()


def pause(holder: str) -> bool:
    """Hold automatic collection off for ``holder`` (idempotent per holder).
    Returns whether this call turned it off."""
    global _we_disabled
    if not enabled():
        return False
    with _lock:
        if holder in _holders:
            return False
        _holders[holder] = time.monotonic()
        if len(_holders) == 1 and gc.isenabled():
            gc.disable()
            _we_disabled = True
            _start_timer()
            return True
        return False


def _start_timer() -> None:
    global _timer
    _timer = threading.Timer(MAX_HOLD_S, _expire)
    _timer.daemon = True
    _timer.start()


def _expire() -> None:
    """The bound: every holder lets go (the next update pauses again)."""
    for holder in holders():
        resume(holder)


def resume(holder: str) -> bool:
    """Let go for ``holder``. Returns whether this call turned collection back on."""
    global _we_disabled, _timer
    with _lock:
        if holder not in _holders:
            return False
        _holders.pop(holder, None)
        if not _holders and _we_disabled:
            _we_disabled = False
            gc.enable()
            if _timer is not None and _timer is not threading.current_thread():
                _timer.cancel()
            _timer = None
            return True
        return False


def holders() -> Set[str]:
    with _lock:
        return set(_holders)


def held_for(holder: str) -> float:
    """Seconds ``holder`` has held collection off (0 when it does not)."""
    with _lock:
        t = _holders.get(holder)
    return 0.0 if t is None else time.monotonic() - t
