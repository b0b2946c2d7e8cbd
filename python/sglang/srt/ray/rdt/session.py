"""The engine's weight-update session: quiesce, let ranks pull, finalize.

An update must never be half-visible: no request may compute with some
parameters old and others new, and no request may span two versions. The
session gives that guarantee at the engine's front door (the tokenizer manager,
where requests enter):

``begin``
    take the tokenizer manager's model-update *writer* lock — it waits until
    every in-flight request finished and holds new ones back — then open
    sglang's weight-update session on every rank (``begin_weight_update``);
``end(weight_version)``
    on every rank: post-load processing, cache flush, version bump
    (``finalize_weight_update``); then release the lock, so requests resume on
    the complete new weights;
``abort``
    close the session without a version bump; ranks that pulled report their
    weights as inconsistent until a later update is finalized.

A session not ended within its lease (the trainer died, say) is aborted by the
engine itself, so a dead trainer cannot stop serving forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 300.0
DEFAULT_DRAIN_TIMEOUT_S = 120.0
RANK_CALL_TIMEOUT_S = 300.0


class WeightSyncSessionError(RuntimeError):
    pass


class WeightSyncSession:
    """Front-door update session; one per engine, used from its event loop."""

    def __init__(self, tokenizer_manager, get_actors: Callable[[], List[Any]]):
        self._tm = tokenizer_manager
        self._get_actors = get_actors
        self._mutex = asyncio.Lock()
        self._session_id: Optional[str] = None
        self._opened_at: Optional[float] = None
        self._lease_task: Optional[asyncio.Task] = None
        self.weights_consistent = True
        self.inconsistent_reason: Optional[str] = None
        self.weight_version: Optional[str] = None
        self.updates = 0
        self.failures = 0

    # ------------------------------------------------------------------ #
    async def _on_ranks(self, method: str, *args, timeout_s: float = RANK_CALL_TIMEOUT_S):
        import ray

        actors = self._get_actors()
        if not actors:
            raise WeightSyncSessionError("the engine has no scheduler actors")
        refs = [getattr(a, method).remote(*args) for a in actors]
        loop = asyncio.get_running_loop()
        # ray.get in a worker thread keeps the engine's event loop serving.
        return await loop.run_in_executor(None, lambda: ray.get(refs, timeout=timeout_s))

    def status(self) -> Dict[str, Any]:
        return {
            "update_open": self._session_id is not None,
            "session_id": self._session_id,
            "open_seconds": (time.monotonic() - self._opened_at) if self._opened_at else None,
            "weights_consistent": self.weights_consistent,
            "inconsistent_reason": self.inconsistent_reason,
            "weight_version": self.weight_version,
            "updates": self.updates,
            "failed_updates": self.failures,
        }

    # ------------------------------------------------------------------ #
    async def begin(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> Dict[str, Any]:
        async with self._mutex:
            if self._session_id is not None:
                raise WeightSyncSessionError(
                    f"an update session is already open ({self._session_id}); "
                    "end or abort it first"
                )
            lock = self._tm.model_update_lock
            try:
                await asyncio.wait_for(lock.acquire_writer(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                raise WeightSyncSessionError(
                    f"in-flight requests did not finish within {drain_timeout_s:.0f} s; "
                    "nothing was changed (raise drain_timeout_s or abort requests)"
                ) from None
            try:
                await self._on_ranks("begin_weight_update")
            except BaseException:
                await lock.release_writer()
                raise
            self._session_id = uuid.uuid4().hex[:12]
            self._opened_at = time.monotonic()
            self._lease_task = asyncio.ensure_future(
                self._expire(self._session_id, lease_s)
            )
            logger.info(
                "[RDT] update session %s open (generation paused, lease %.0f s)",
                self._session_id, lease_s,
            )
            return {"session_id": self._session_id, "lease_s": lease_s}

    async def end(
        self, weight_version: Optional[str] = None, flush_cache: bool = True,
        session_id: Optional[str] = None,
    ) -> Dict[str, Any]:
        async with self._mutex:
            self._check_open(session_id)
            try:
                results = await self._on_ranks(
                    "finalize_weight_update", weight_version, flush_cache
                )
            except BaseException as e:
                await self._close(
                    f"finalize failed on a rank: {type(e).__name__}: {e}", abort_ranks=True
                )
                raise
            if weight_version is not None:
                self._tm._update_weight_version_if_provided(str(weight_version))
                self.weight_version = str(weight_version)
            self.weights_consistent, self.inconsistent_reason = True, None
            self.updates += 1
            seconds = time.monotonic() - self._opened_at
            await self._release()
            logger.info(
                "[RDT] update session finalized in %.3f s: weight_version=%s",
                seconds, weight_version,
            )
            return {"success": True, "weight_version": weight_version,
                    "seconds": seconds, "ranks": results}

    async def abort(
        self, reason: str = "update aborted by the trainer", session_id: Optional[str] = None
    ) -> Dict[str, Any]:
        async with self._mutex:
            self._check_open(session_id)
            await self._close(reason, abort_ranks=True)
            return self.status()

    # ------------------------------------------------------------------ #
    def _check_open(self, session_id: Optional[str]) -> None:
        if self._session_id is None:
            raise WeightSyncSessionError("no update session is open; call begin first")
        if session_id is not None and session_id != self._session_id:
            raise WeightSyncSessionError(
                f"session {session_id} is not the open one ({self._session_id}); it "
                "was aborted (lease expired?)"
            )

    async def _close(self, reason: str, abort_ranks: bool) -> None:
        self.failures += 1
        touched = True
        if abort_ranks:
            try:
                statuses = await self._on_ranks("abort_weight_update", reason)
                touched = any(not s.get("weights_consistent", False) for s in statuses)
            except BaseException as e:  # a rank is gone: assume the worst
                logger.error("[RDT] aborting the update on the ranks failed: %s", e)
        if touched:
            self.weights_consistent = False
            self.inconsistent_reason = reason
        logger.error(
            "[RDT] update session %s aborted: %s (weights consistent: %s)",
            self._session_id, reason, self.weights_consistent,
        )
        await self._release()

    async def _release(self) -> None:
        task, self._lease_task = self._lease_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self._session_id, self._opened_at = None, None
        await self._tm.model_update_lock.release_writer()

    async def _expire(self, session_id: str, lease_s: float) -> None:
        await asyncio.sleep(lease_s)
        async with self._mutex:
            if self._session_id != session_id:
                return
            await self._close(
                f"the update session was not finalized within its {lease_s:.0f} s lease "
                "(trainer gone?)",
                abort_ranks=True,
            )
