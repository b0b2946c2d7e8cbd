"""HTTP endpoints that --enable-rdt-weight-sync adds to the Ray HTTP server, next to sglang's lifecycle ones:

    GET  /parallelism_config[?rank=R]  the per-rank layout
    POST /weight_sync/begin   {"lease_s": 300, "drain_timeout_s": 120}
    POST /weight_sync/end     {"weight_version": "7", "flush_cache": true, "session_id": ...}
    POST /weight_sync/abort   {"reason": "...", "session_id": ...}
    POST /register_lora_adapter {"lora_name": ..., "config_dict": {PEFT adapter_config}}
    GET  /weight_sync/status  the session, the engine-wide view and every rank's status
    GET  /weight_sync/ranks   the Ray namespace and every rank's actor name and layout

Engine-wide figures are derived from the ranks' own state, never stored here.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Dict, List, Optional

from fastapi import Body, Request
from fastapi.responses import ORJSONResponse

from sglang.srt.ray.rdt.errors import WeightSyncSessionError
from sglang.srt.ray.rdt.ranks import call_ranks_async
from sglang.srt.ray.rdt.engine.session import WeightSyncSession
from sglang.srt.utils.auth import AuthLevel, auth_level

STATUS_RANK_TIMEOUT_S = 10.0


def engine_view(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The engine-wide figures, derived from every rank's status."""
    bad = [r for r in ranks if not r.get("weights_consistent", True)]
    versions = {r.get("weight_version") for r in ranks}
    return {"weights_consistent": not bad, "inconsistent_reason": bad[0].get("inconsistent_reason") if bad else None,
            "weight_version": versions.pop() if len(versions) == 1 else sorted(map(str, versions)),
            "updates": min((r.get("updates", 0) for r in ranks), default=0),
            "failed_updates": max((r.get("failed_updates", 0) for r in ranks), default=0)}


async def full_status(session: WeightSyncSession) -> Dict[str, Any]:
    status = session.status()
    try:
        ranks = await call_ranks_async(session.get_actors(), "get_weight_sync_status", timeout_s=STATUS_RANK_TIMEOUT_S)
    except Exception as e:
        status.update(weights_consistent=False,
                      inconsistent_reason=f"the ranks' status could not be read: {e}", ranks=None)
        return status
    status.update(engine_view(ranks), ranks=ranks)
    return status


async def rank_directory(actors: List[Any]) -> Dict[str, Any]:
    """``GET /weight_sync/ranks``: namespace, actor names (global rank order), parallelism; no secret."""
    placements = await call_ranks_async(actors, "get_ray_placement", timeout_s=STATUS_RANK_TIMEOUT_S)
    configs = await call_ranks_async(actors, "get_parallelism_config", timeout_s=STATUS_RANK_TIMEOUT_S)
    first = configs[0] if configs else {}
    return {"namespace": placements[0]["namespace"] if placements else None,
            **{k: first.get(k) or 1 for k in ("dp_size", "tp_size", "pp_size")},
            "ranks": [{"rank": i, "actor_name": p["actor_name"], "namespace": p["namespace"], "node_id": p["node_id"],
                       "parallelism": c} for i, (p, c) in enumerate(zip(placements, configs))]}


def install_weight_sync_routes(app, server_args, launched) -> WeightSyncSession:
    from sglang.srt.entrypoints.server_info_extras import register_server_info_provider
    from sglang.srt.model_executor.parallelism_config import current_store, install_parallelism_config_read_route

    session = WeightSyncSession(launched.tokenizer_manager, lambda: launched.scheduler_init_result.scheduler_actors)
    install_parallelism_config_read_route(app, current_store)
    register_server_info_provider("weight_sync", lambda: full_status(session))

    async def call(coro):
        try:
            return ORJSONResponse({"success": True, **(await coro)})
        except WeightSyncSessionError as e:
            return ORJSONResponse({"success": False, "message": str(e)}, status_code=HTTPStatus.CONFLICT)
        except Exception as e:
            return ORJSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"},
                                  status_code=HTTPStatus.INTERNAL_SERVER_ERROR)

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
        return await call(session.end(None if version is None else str(version),
                                      bool(body.get("flush_cache", True)), body.get("session_id")))

    @app.post("/weight_sync/abort")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def weight_sync_abort(request: Request, body: Optional[Dict[str, Any]] = Body(None)):
        body = body or {}
        return await call(session.abort(body.get("reason", "update aborted by the trainer"), body.get("session_id")))

    @app.post("/register_lora_adapter")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def register_lora_adapter(request: Request, body: Dict[str, Any] = Body(...)):
        if not isinstance(body.get("lora_name"), str) or not isinstance(body.get("config_dict"), dict):
            return ORJSONResponse({"success": False, "message": 'expected {"lora_name": str, "config_dict": '
                                   "{PEFT adapter_config}}"}, status_code=HTTPStatus.BAD_REQUEST)
        return await call(session.register_lora(body["lora_name"], body["config_dict"]))

    @app.get("/weight_sync/ranks")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def weight_sync_ranks(request: Request):
        try:
            return ORJSONResponse(await rank_directory(session.get_actors()))
        except Exception as e:
            return ORJSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"},
                                  status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/weight_sync/status")
    async def weight_sync_status(request: Request):
        return ORJSONResponse(await full_status(session))

    return session
