"""Optionally keep Python's cyclic garbage collector out of a rank's weight update (never the trainer's).

With ``SGLANG_RDT_PAUSE_GC=1`` (off by default: the host's interpreter is left alone unless asked) collection is off
from a rank's first pull until the update ends, or, on a rank kept paused, until generation continues; a timer turns
it back on after :data:`MAX_HOLD_S` whatever happens. Holders nest: the first turns it off (if on), the last back on.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Dict, Optional, Set

# at module level: importing it inside a rank's first pull would slow that pull
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
    """Hold automatic collection off for ``holder`` (idempotent per holder). Returns whether this call turned it off."""
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
