"""Start-up, failure and shutdown of the Ray backend's scheduler actors.

Upstream waits for the actors without a bound and never looks at them again:
an actor that cannot be placed keeps the launcher waiting forever, and one whose
event loop dies leaves the HTTP server answering 503 forever. Here:

* ``wait_actors_ready`` bounds the wait for every actor's ``get_info`` and kills
  the whole group on any failure, with an error that says what happened;
* ``SchedulerActorWatchdog`` turns a crashed event loop into the same SIGQUIT a
  crashed scheduler *process* sends in the multiprocessing backend, so the
  server exits instead of serving 503;
* ``release`` kills the actors and removes the placement group the engine made.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, List, Optional, Sequence

import ray

logger = logging.getLogger(__name__)


def _kill_quietly(actors: Sequence) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already gone
            logger.debug("ray.kill(%s) failed: %s", actor, e)


def wait_actors_ready(actors: List, timeout_s: Optional[float]) -> List[dict]:
    """``get_info`` from every actor within ``timeout_s``; kill all on failure."""
    refs = [actor.get_info.remote() for actor in actors]
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        _kill_quietly(actors)
        raise RuntimeError(
            f"{len(pending)} of {len(actors)} scheduler actor(s) did not finish "
            f"initializing within {timeout_s:.0f} s (not placed, or loading too "
            "slowly); raise --ray-startup-timeout if the model needs longer"
        ) from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        _kill_quietly(actors)
        raise RuntimeError(f"Scheduler actor failed to initialize: {e}") from e


class SchedulerActorWatchdog:
    """Signal the server when any scheduler actor's event loop fails.

    A loop that *returns* is a graceful shutdown (``ShutdownReq``) and is left
    alone; one that raises, or an actor that dies, is a crash. ``stop()`` before
    killing actors on purpose.
    """

    def __init__(
        self,
        event_loop_refs: List,
        on_failure: Optional[Callable[[str], None]] = None,
        poll_s: float = 1.0,
    ):
        self._refs = list(event_loop_refs)
        self._on_failure = on_failure or _sigquit_self
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "SchedulerActorWatchdog":
        if self._refs and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name="ray-scheduler-watchdog"
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        pending = list(self._refs)
        while pending and not self._stop.is_set():
            done, pending = ray.wait(pending, num_returns=1, timeout=self._poll_s)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    if self._stop.is_set():
                        return
                    msg = f"a Ray scheduler actor failed while serving: {e}"
                    logger.error(msg)
                    self._on_failure(msg)
                    return


def _sigquit_self(_msg: str) -> None:
    os.kill(os.getpid(), signal.SIGQUIT)


def release(actors: Sequence, placement_group=None, watchdog=None) -> None:
    """Kill scheduler actors and remove the placement group the engine created."""
    if watchdog is not None:
        watchdog.stop()
    _kill_quietly(actors)
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception as e:
            logger.debug("remove_placement_group failed: %s", e)
