"""The engine's weight-update session: sglang's own lifecycle, plus a drain and a lease.

It keeps no update state (the ranks do). ``begin`` takes the tokenizer manager's model-update writer lock
(draining in-flight requests, holding new ones), pauses generation in place and runs ``begin_weight_update``;
``end`` sets the version, runs ``end_weight_update``, flushes, continues generation and releases the lock;
``abort`` drops the update without a version bump. A session not ended within its lease is aborted by the
engine, so a dead trainer cannot stop serving forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from sglang.srt.ray.rdt.defaults import SESSION_DRAIN_TIMEOUT_S, SESSION_LEASE_S
from sglang.srt.ray.rdt.errors import WeightSyncSessionError

logger = logging.getLogger(__name__)

TENSOR_PATH = "__tensor__"  # the lora_path of adapters made from tensors (sglang's own tensor loads use it too)


class WeightSyncSession:
    """Front-door update session; one per engine, used from its event loop."""

    def __init__(self, tokenizer_manager, get_actors: Callable[[], List[Any]]):
        self._tm = tokenizer_manager
        self.get_actors = get_actors
        self._mutex = asyncio.Lock()
        self._session_id: Optional[str] = None
        self._opened_at: Optional[float] = None
        self._lease_task: Optional[asyncio.Task] = None
        self._paused_here = False  # this session paused generation (else the caller had)

    def status(self) -> Dict[str, Any]:
        return {"update_open": self._session_id is not None, "session_id": self._session_id,
                "open_seconds": (time.monotonic() - self._opened_at) if self._opened_at else None}

    async def _lifecycle(self, communicator_name: str, obj) -> None:
        """One of sglang's lifecycle calls on every rank (this session holds the writer lock already)."""
        from sglang.srt.managers.communicator import FanOutCommunicator

        success, message = FanOutCommunicator.merge_results(await getattr(self._tm, communicator_name)(obj))
        if not success:
            raise WeightSyncSessionError(message)

    async def begin(self, lease_s: float = SESSION_LEASE_S,
                    drain_timeout_s: float = SESSION_DRAIN_TIMEOUT_S) -> Dict[str, Any]:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        async with self._mutex:
            if self._session_id is not None:
                raise WeightSyncSessionError(
                    f"an update session is already open ({self._session_id}); end or abort it first")
            lock = self._tm.model_update_lock
            try:
                await asyncio.wait_for(lock.acquire_writer(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                raise WeightSyncSessionError(f"in-flight requests did not finish within {drain_timeout_s:.0f} s; "
                                             "nothing was changed (raise drain_timeout_s or abort requests)") from None
            try:
                await self._pause()
                await self._lifecycle("begin_weight_update_communicator", BeginWeightUpdateReqInput())
            except BaseException:
                await self._continue()
                await lock.release_writer()
                raise
            self._session_id = uuid.uuid4().hex[:12]
            self._opened_at = time.monotonic()
            self._lease_task = asyncio.ensure_future(self._expire(self._session_id, lease_s))
            logger.info("[RDT] update session %s open (generation paused, lease %.0f s)", self._session_id, lease_s)
            return {"session_id": self._session_id, "lease_s": lease_s}

    async def end(self, weight_version: Optional[str] = None, flush_cache: bool = True,
                  session_id: Optional[str] = None) -> Dict[str, Any]:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput, UpdateWeightVersionReqInput

        async with self._mutex:
            self._check_open(session_id)
            try:
                if weight_version is not None:
                    await self._tm.update_weight_version(UpdateWeightVersionReqInput(new_version=str(weight_version)))
                await self._lifecycle("end_weight_update_communicator", EndWeightUpdateReqInput())
                flushed = bool((await self._tm.flush_cache()).success) if flush_cache else False
            except WeightSyncSessionError as e:  # the ranks closed the session; the update is not a clean one
                await self._release()
                logger.error("[RDT] update session ended with a problem: %s", e)
                raise
            except BaseException as e:
                await self._close(f"finalize failed: {type(e).__name__}: {e}")
                raise
            seconds = time.monotonic() - self._opened_at
            await self._release()
            logger.info("[RDT] update session finalized in %.3f s: weight_version=%s", seconds, weight_version)
            return {"success": True, "weight_version": weight_version, "seconds": seconds, "flushed_cache": flushed}

    async def abort(self, reason: str = "update aborted by the trainer",
                    session_id: Optional[str] = None) -> Dict[str, Any]:
        async with self._mutex:
            self._check_open(session_id)
            await self._close(reason)
            return self.status()

    def _check_open(self, session_id: Optional[str]) -> None:
        if self._session_id is None:
            raise WeightSyncSessionError("no update session is open; call begin first")
        if session_id is not None and session_id != self._session_id:
            raise WeightSyncSessionError(f"session {session_id} is not the open one ({self._session_id}); it "
                                         "was aborted (lease expired?)")

    async def _close(self, reason: str) -> None:
        """Drop the update on every rank (a touched one marks itself inconsistent), then release."""
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        try:
            await self._lifecycle("end_weight_update_communicator",
                                  EndWeightUpdateReqInput(abort=True, abort_reason=reason))
        except BaseException as e:  # a rank is gone: it reports itself, if it can
            logger.error("[RDT] aborting the update on the ranks failed: %s", e)
        logger.error("[RDT] update session %s aborted: %s", self._session_id, reason)
        await self._release()

    async def register_lora(self, lora_name: str, config_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``POST /register_lora_adapter``: register on every rank group, then serve the name. Returns the first
        group's answer (what a trainer sends), every group's under ``groups``."""
        from sglang.srt.lora.lora_registry import LoRARef
        from sglang.srt.ray.rdt.ranks import call_ranks_async

        if not getattr(self._tm, "lora_registry", None):
            raise WeightSyncSessionError("LoRA is off on this engine: start it with --enable-lora, "
                                         "--max-lora-rank and --lora-target-modules")
        known = self._tm.lora_registry.get_all_adapters().get(lora_name)
        if known is not None and known.lora_path != TENSOR_PATH:
            raise WeightSyncSessionError(f"LoRA adapter {lora_name!r} was loaded from {known.lora_path}; "
                                         "unload it first, or register another name")
        ref = known or LoRARef(lora_name=lora_name, lora_path=TENSOR_PATH, pinned=False)
        actors = [a for a, st in zip(self.get_actors(), await call_ranks_async(
            self.get_actors(), "get_weight_sync_status", timeout_s=60)) if st.get("group_entry", True)]
        try:
            out = await call_ranks_async(actors, "register_lora_adapter", lora_name, config_dict, ref.lora_id)
        except Exception as e:
            raise WeightSyncSessionError(f"registering LoRA adapter {lora_name!r} failed: {e}") from e
        if known is None:  # (under the id the ranks serve it by: kept from an earlier registration, if any)
            await self._tm.lora_registry.register(LoRARef(lora_id=out[0]["lora_id"], lora_name=lora_name,
                                                          lora_path=TENSOR_PATH, pinned=False))
        return {**out[0], "groups": out}

    async def _pause(self) -> None:
        """Pause generation in place unless the caller paused it already."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        async with self._tm.is_pause_cond:
            paused = self._tm.is_pause
        if not paused:
            await self._tm.pause_generation(PauseGenerationReqInput(mode="in_place"))
            self._paused_here = True

    async def _continue(self) -> None:
        if self._paused_here:
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput

            self._paused_here = False
            await self._tm.continue_generation(ContinueGenerationReqInput())

    async def _release(self) -> None:
        task, self._lease_task = self._lease_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self._session_id, self._opened_at = None, None
        try:
            await self._continue()
        finally:
            await self._tm.model_update_lock.release_writer()

    async def _expire(self, session_id: str, lease_s: float) -> None:
        await asyncio.sleep(lease_s)
        async with self._mutex:
            if self._session_id != session_id:
                return
            await self._close(f"the update session was not finalized within its {lease_s:.0f} s lease (trainer gone?)")
