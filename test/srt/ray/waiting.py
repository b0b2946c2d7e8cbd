"""Waiting on a condition, bounded: how the suite waits, never sleep-and-hope.

Imports nothing, so the GPU tests (``gpu/``), which run without the suite's
``conftest.py``, use it as well; the other tests take it from ``conftest``.
"""

from __future__ import annotations

import time


def wait_until(pred, timeout: float, interval: float = 0.5, what: str = "condition"):
    """``pred()``'s first truthy value, asked every ``interval`` seconds;
    :class:`TimeoutError` naming ``what`` once ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
