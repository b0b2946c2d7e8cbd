"""Listeners told before a scheduler's weights are released and after they return.

``--enable-memory-saver`` releases weight memory (``release_memory_occupation``)
and maps it back at the same addresses, without its contents
(``resume_memory_occupation``). Anything that registered that memory with a
transport (NIXL registrations are keyed by address) must drop the registration
first and may register again after the resume. A listener has
``on_weights_released()`` and ``on_weights_resumed()``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def add_weight_memory_listener(scheduler, listener) -> None:
    listeners = getattr(scheduler, "weight_memory_listeners", None)
    if listeners is None:
        listeners = []
        scheduler.weight_memory_listeners = listeners
    listeners.append(listener)


def notify_weights_released(scheduler) -> None:
    for listener in getattr(scheduler, "weight_memory_listeners", None) or ():
        listener.on_weights_released()


def notify_weights_resumed(scheduler) -> None:
    for listener in getattr(scheduler, "weight_memory_listeners", None) or ():
        try:
            listener.on_weights_resumed()
        except Exception as e:  # serving goes on; the next pull re-registers
            logger.error("weight memory listener failed after resume: %s", e)
