"""Keep Python's cyclic garbage collector out of a rank's weight update.

A full (generation 2) collection in a process that holds Ray, torch and a
model stops every thread of it for 75-107 ms (measured on an H200 host,
docs/performance.md) — longer than a whole colocated update. So a rank's
update runs with automatic collection off, from its first pull until the
update ends (finalize or abort) — or, on a rank whose generation stays paused
(``/pause_generation`` in retract or in_place mode, miles' way), until
generation continues (at most :data:`MAX_HOLD_S`): a collection pending when
the update ends would otherwise fire inside the next update's first pull.
Reference counting still frees all acyclic garbage meanwhile.
``SGLANG_RDT_PAUSE_GC=0`` leaves the collector alone. The trainer's collector
is the trainer's: nothing here touches it.

Holders nest: the collector is turned off by the first holder (only if it was
on) and turned back on when the last one lets go.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Dict, Set

# A rank that stays paused longer than this between updates collects again.
MAX_HOLD_S = 300.0

_lock = threading.Lock()
_holders: Dict[str, float] = {}  # holder -> when it began holding (monotonic)
_we_disabled = False


def enabled() -> bool:
    from sglang.srt.environ import envs

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
            return True
        return False


def resume(holder: str) -> bool:
    """Let go for ``holder``. Returns whether this call turned collection back on."""
    global _we_disabled
    with _lock:
        if holder not in _holders:
            return False
        _holders.pop(holder, None)
        if not _holders and _we_disabled:
            _we_disabled = False
            gc.enable()
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
