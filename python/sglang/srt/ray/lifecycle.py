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
import time
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


def release(
    actors: Sequence, placement_group=None, watchdog=None, grace_s: float = 10.0
) -> None:
    """Kill scheduler actors and remove the placement group the engine created.

    Each actor first gets ``grace_s`` to release its NIXL registrations.
    """
    if watchdog is not None:
        watchdog.stop()
    if actors and grace_s > 0:
        refs = []
        for actor in actors:
            try:
                refs.append(actor.shutdown_weight_sync.remote())
            except Exception:
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    _kill_quietly(actors)
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception as e:
            logger.debug("remove_placement_group failed: %s", e)


# --------------------------------------------------------------------------- #
# Detached actors and the job that launched them
# --------------------------------------------------------------------------- #
OWNER_JOB_ENV = "SGLANG_RAY_ENGINE_OWNER_JOB"


def job_is_dead(job_id_hex: str) -> Optional[bool]:
    """True/False from the GCS job table; None if the job is unknown."""
    from sglang.srt.ray.rdt.transport.compat import job_table

    for job in job_table():
        jid = job.get("JobID")
        jid = jid.hex() if hasattr(jid, "hex") and not isinstance(jid, str) else jid
        if jid == job_id_hex:
            return bool(job.get("IsDead"))
    return None


def watch_owner_job(on_dead: Callable[[str], None], interval_s: Optional[float] = None):
    """In a detached actor: call ``on_dead`` once the launching job is gone.

    Detached actors outlive the job that made them; if the launcher is
    SIGKILLed nobody kills them, and they would hold the node's resources and
    the engine's actor names forever.
    """
    from sglang.srt.environ import envs

    owner = envs.SGLANG_RAY_ENGINE_OWNER_JOB.get()
    if not owner:
        return None
    interval_s = interval_s or envs.SGLANG_RAY_OWNER_CHECK_INTERVAL.get()

    def run():
        while True:
            time.sleep(interval_s)
            try:
                dead = job_is_dead(owner)
            except Exception as e:  # GCS hiccup: try again
                logger.debug("owner job check failed: %s", e)
                continue
            if dead:
                on_dead(f"the job {owner} that launched this engine is gone")
                return

    t = threading.Thread(target=run, daemon=True, name="ray-owner-watch")
    t.start()
    return t


def claim_actor_name(name: str, namespace: Optional[str] = None, timeout_s: float = 30.0) -> None:
    """Make sure a detached actor ``name`` can be created.

    A stale actor from a launcher that died (its job is dead) is killed and
    replaced; a live one is a clear error instead of a silent clash.
    """
    try:
        stale = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    owner = None
    try:
        owner = ray.get(stale.get_ray_placement.remote(), timeout=10)["job_id"]
    except Exception as e:
        logger.warning("stale actor %s does not answer (%s); replacing it", name, e)
    if owner is not None and job_is_dead(owner) is False:
        raise RuntimeError(
            f"a live engine (Ray job {owner}) already holds the actor name {name!r}: "
            "another server runs on this node with the same --port; choose another "
            "port or shut that server down"
        )
    logger.warning("replacing stale scheduler actor %s (launcher job %s is gone)", name, owner)
    ray.kill(stale, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the stale actor {name!r} did not go away within {timeout_s:.0f} s")
