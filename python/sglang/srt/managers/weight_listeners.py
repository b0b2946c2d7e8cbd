"""Listeners a scheduler tells about its weights: memory, update sessions, pauses.

sglang's scheduler owns the weight-update lifecycle (``begin_weight_update``,
``end_weight_update``, ``pause_generation``, ``continue_generation``,
``release/resume_memory_occupation``). Code that keeps state about the weights
(the RDT weight-sync rank core, :mod:`sglang.srt.ray.rdt.engine.update_state`) learns
about those events here, whichever path triggered them (HTTP, the Ray engine,
the offline engine), instead of keeping a lifecycle of its own.

A listener implements any of these methods (all run on the scheduler thread):

``on_weights_released()`` / ``on_weights_resumed()``
    ``--enable-memory-saver`` releases weight memory and maps it back at the
    same addresses without its contents: anything that registered that memory
    with a transport keyed by address (NIXL) must let go first and may
    register again after the resume.
``on_weight_update_begin()``
    a weight-update session opened on this rank.
``on_weight_update_end(aborted) -> Optional[str]``
    the session closed (post-load processing done); ``aborted``: None, or
    why the update was dropped (``end_weight_update`` with ``abort``). A
    returned message is a problem with the update (e.g. two trainers wrote
    one parameter): the scheduler reports ``end_weight_update`` as failed
    with that message (a problem on any rank of the TP group).
``on_weights_loaded(source)``
    an ``update_weights_from_{disk,distributed,tensor,ipc}`` call finished
    loading (``source``: ``"disk"``, ...): its post-load processing may have
    replaced parameters, so pointers kept into them must be looked at again.
``on_generation_paused(mode)`` / ``on_generation_continued()``
    ``pause_generation`` (any mode) / ``continue_generation`` reached this rank.
"""

from __future__ import annotations

import logging
import weakref
from typing import List, Optional

logger = logging.getLogger(__name__)


# Each scheduler's listeners, held here (the scheduler object is not touched).
_LISTENERS: "weakref.WeakKeyDictionary[object, List[object]]" = weakref.WeakKeyDictionary()


def add_weight_listener(scheduler, listener) -> None:
    _LISTENERS.setdefault(scheduler, []).append(listener)


def _listeners(scheduler, method: str):
    for listener in _LISTENERS.get(scheduler, ()):
        fn = getattr(listener, method, None)
        if fn is not None:
            yield fn


def notify_weights_released(scheduler) -> None:
    for fn in _listeners(scheduler, "on_weights_released"):
        fn()


def notify_weights_resumed(scheduler) -> None:
    for fn in _listeners(scheduler, "on_weights_resumed"):
        try:
            fn()
        except Exception as e:  # serving goes on; the next pull re-registers
            logger.error("weight listener failed after resume: %s", e)


def notify_weights_loaded(scheduler, source: str) -> None:
    for fn in _listeners(scheduler, "on_weights_loaded"):
        try:
            fn(source)
        except Exception as e:  # the load itself is done either way
            logger.error("weight listener failed after a %s load: %s", source, e)


def notify_weight_update_begin(scheduler) -> None:
    for fn in _listeners(scheduler, "on_weight_update_begin"):
        fn()


def notify_weight_update_end(scheduler, aborted: Optional[str] = None) -> Optional[str]:
    """The problems listeners found with the update that ended, or None."""
    problems: List[str] = []
    for fn in _listeners(scheduler, "on_weight_update_end"):
        try:
            problem = fn(aborted)
        except Exception as e:  # the session is closed either way
            problem = f"{type(e).__name__}: {e}"
            logger.error("weight listener failed at end_weight_update: %s", problem)
        if problem:
            problems.append(problem)
    return "; ".join(problems) or None


def gather_problems(problem: Optional[str], group) -> Optional[str]:
    """Every rank's ``problem`` with the update that ended, over the TP
    group's CPU ``group`` (a collective: every rank calls it at the same
    point, so it is their barrier too). None when no rank found one."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return problem
    problems: List[Optional[str]] = [None] * size
    dist.all_gather_object(problems, problem, group=group)
    return "; ".join(f"TP rank {i}: {p}" for i, p in enumerate(problems) if p) or None


def notify_generation_paused(scheduler, mode: str) -> None:
    for fn in _listeners(scheduler, "on_generation_paused"):
        fn(mode)


def notify_generation_continued(scheduler) -> None:
    for fn in _listeners(scheduler, "on_generation_continued"):
        fn()
