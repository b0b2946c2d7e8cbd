"""HTTP endpoints of the weight-update session (added to the Ray HTTP server).

    POST /weight_sync/begin   {"lease_s": 300, "drain_timeout_s": 120}
    POST /weight_sync/end     {"weight_version": "7", "flush_cache": true, "session_id": ...}
    POST /weight_sync/abort   {"reason": "...", "session_id": ...}
    GET  /weight_sync/status  engine + per-rank status (consistency, counters)

See :mod:`sglang.srt.ray.rdt.session` for the guarantees.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any, Dict, Optional

from fastapi import Body, Request
from fastapi.responses import ORJSONResponse

from sglang.srt.ray.rdt.session import WeightSyncSession, WeightSyncSessionError
from sglang.srt.utils.auth import AuthLevel, auth_level

STATUS_RANK_TIMEOUT_S = 10.0


async def rank_statuses(session: WeightSyncSession) -> Dict[str, Any]:
    import ray

    actors = session._get_actors()
    refs = [a.get_weight_sync_status.remote() for a in actors]
    loop = asyncio.get_running_loop()
    try:
        ranks = await loop.run_in_executor(
            None, lambda: ray.get(refs, timeout=STATUS_RANK_TIMEOUT_S)
        )
    except Exception as e:
        return {"ranks": None, "ranks_error": f"{type(e).__name__}: {e}"}
    return {"ranks": ranks}


async def full_status(session: WeightSyncSession) -> Dict[str, Any]:
    status = session.status()
    status.update(await rank_statuses(session))
    ranks = status.get("ranks") or []
    if any(not r.get("weights_consistent", True) for r in ranks):
        status["weights_consistent"] = False
        status["inconsistent_reason"] = status["inconsistent_reason"] or next(
            r.get("inconsistent_reason") for r in ranks if not r.get("weights_consistent", True)
        )
    return status


def install_weight_sync_routes(app, session: WeightSyncSession) -> None:
    from sglang.srt.entrypoints.server_info_extras import register_server_info_provider

    # /server_info carries the same status under "weight_sync".
    register_server_info_provider("weight_sync", lambda: full_status(session))
    async def call(coro):
        try:
            return ORJSONResponse({"success": True, **(await coro)})
        except WeightSyncSessionError as e:
            return ORJSONResponse(
                {"success": False, "message": str(e)}, status_code=HTTPStatus.CONFLICT
            )
        except Exception as e:
            return ORJSONResponse(
                {"success": False, "message": f"{type(e).__name__}: {e}"},
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )

    @app.post("/weight_sync/begin")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def weight_sync_begin(request: Request, body: Optional[Dict[str, Any]] = Body(None)):
        body = body or {}
        kwargs = {k: float(body[k]) for k in ("lease_s", "drain_timeout_s") if k in body}
        return await call(session.begin(**kwargs))

    @app.post("/weight_sync/end")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def weight_sync_end(request: Request, body: Optional[Dict[str, Any]] = Body(None)):
        body = body or {}
        version = body.get("weight_version")
        return await call(
            session.end(
                None if version is None else str(version),
                bool(body.get("flush_cache", True)),
                body.get("session_id"),
            )
        )

    @app.post("/weight_sync/abort")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def weight_sync_abort(request: Request, body: Optional[Dict[str, Any]] = Body(None)):
        body = body or {}
        return await call(
            session.abort(body.get("reason", "update aborted by the trainer"), body.get("session_id"))
        )

    @app.get("/weight_sync/status")
    async def weight_sync_status(request: Request):
        return ORJSONResponse(await full_status(session))
