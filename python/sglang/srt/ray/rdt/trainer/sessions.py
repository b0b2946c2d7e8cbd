"""The engine's update session as the trainer drives it: over HTTP, through an in-process ``RayEngine``, or
(:class:`CallerPausedSession`, the caller paused generation) by finalizing or aborting each TP/PP group."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional

from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError, WeightSyncSessionError

logger = logging.getLogger(__name__)

class HttpSession:
    def __init__(self, url: str, lease_s: float, timeout_s: float, api_key: Optional[str] = None):
        self.url, self.lease_s, self.timeout_s, self.api_key = url.rstrip("/"), lease_s, timeout_s, api_key

    def post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        from sglang.srt.ray.rdt.trainer.discovery import http

        try:
            return http("POST", self.url, path, self.api_key, self.timeout_s, body)
        except WeightSyncError as e:
            raise WeightSyncSessionError(str(e)) from None

    def begin(self) -> Optional[str]:
        return self.post("/weight_sync/begin", {"lease_s": self.lease_s})["session_id"]

    def end(self, session_id: Optional[str], version: Optional[str], flush_cache: bool):
        return self.post("/weight_sync/end",
                         {"weight_version": version, "flush_cache": flush_cache, "session_id": session_id})

    def abort(self, session_id: Optional[str], reason: str) -> None:
        self.post("/weight_sync/abort", {"reason": reason, "session_id": session_id})


class EngineSession:
    def __init__(self, engine: Any, lease_s: float):
        self.engine, self.lease_s = engine, lease_s

    def begin(self) -> Optional[str]:
        try:
            return self.engine.begin_weight_sync(lease_s=self.lease_s).get("session_id")
        except Exception as e:
            raise WeightSyncSessionError(f"begin_weight_sync failed: {e}") from e

    def end(self, session_id: Optional[str], version: Optional[str], flush_cache: bool):
        try:
            return self.engine.end_weight_sync(weight_version=version, flush_cache=flush_cache)
        except Exception as e:
            raise WeightSyncSessionError(f"end_weight_sync failed: {e}") from e

    def abort(self, session_id: Optional[str], reason: str) -> None:
        self.engine.abort_weight_sync(reason)


class CallerPausedSession:
    def __init__(self, call_all: Callable[..., List[Any]]):
        self.call_all = call_all

    def begin(self) -> Optional[str]:
        return None  # the caller paused generation; ranks refuse pulls otherwise

    def end(self, session_id: Optional[str], version: Optional[str], flush_cache: bool):
        return self.call_all("finalize_weight_update", version, flush_cache)

    def abort(self, session_id: Optional[str], reason: str) -> None:
        # Best effort: a dead rank must not keep the live ones from closing their update.
        try:
            self.call_all("abort_weight_update", reason)
        except WeightSyncRankError as e:
            logger.error("[RDT] abort did not reach every rank: %s", e)


def make_session(url: Optional[str], engine: Any, call_all: Callable[..., List[Any]], lease_s: float,
                 call_timeout_s: float, api_key: Optional[str] = None):
    if url:
        return HttpSession(url, lease_s, call_timeout_s + 30, api_key)
    if engine is not None:
        return EngineSession(engine, lease_s)
    return CallerPausedSession(call_all)
