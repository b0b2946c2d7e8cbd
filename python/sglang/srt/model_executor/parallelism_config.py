"""Per-rank parallelism config: each rank registers it, the bootstrap server serves it.

A trainer that pushes weights into an engine needs each rank's place in the
layout (TP/PP/DP ranks and sizes, attention TP/DP, MoE EP/TP, world and node
rank, device) to send it the right shard. With ``--enable-engine-info-bootstrap``
(implied by ``--enable-rdt-weight-sync``) every ModelRunner PUTs its config to the
engine-info bootstrap server on node 0, which serves:

    GET /parallelism_config?rank=R   one rank (R = the global rank below)
    GET /parallelism_config          all ranks, {"ranks": {R: config}}

The engine's main HTTP port serves the same two routes from the same store
(the Ray HTTP server with --enable-rdt-weight-sync; miles reads it there).

The global rank is ``dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank``
(with attention DP, where DP is folded into TP, ``pp_rank * tp_size + tp_rank``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional

logger = logging.getLogger(__name__)

_FIELDS = (
    "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size",
    "attn_tp_rank", "attn_tp_size", "attn_dp_rank", "attn_dp_size",
    "attn_cp_rank", "attn_cp_size", "moe_ep_rank", "moe_ep_size",
    "moe_tp_rank", "moe_tp_size", "moe_dp_rank", "moe_dp_size",
    "node_rank", "nnodes", "launch_world_rank", "launch_world_size",
)


def global_rank_of(cfg: Dict[str, Any]) -> int:
    tp, pp = cfg.get("tp_size") or 1, cfg.get("pp_size") or 1
    local = (cfg.get("pp_rank") or 0) * tp + (cfg.get("tp_rank") or 0)
    if (cfg.get("attn_dp_size") or 1) > 1:
        return local
    return (cfg.get("dp_rank") or 0) * tp * pp + local


def read_parallelism_config(device_id: Optional[int], device: Optional[str]) -> Dict[str, Any]:
    """This process's parallel layout, from the published runtime context."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    out: Dict[str, Any] = {}
    for name in _FIELDS:
        try:
            value = getattr(parallel, name)
        except Exception:
            value = None
        out[name] = None if value is None else int(value)
    out["world_rank"] = out.pop("launch_world_rank")
    out["world_size"] = out.pop("launch_world_size")
    out["device"] = device
    out["device_id"] = device_id
    out["rank"] = global_rank_of(out)
    return out


def register_parallelism_config(device_id: Optional[int], device: Optional[str]) -> bool:
    """PUT this rank's config to the bootstrap server; failures are logged only."""
    import requests

    from sglang.srt.runtime_context import get_model, get_parallel
    from sglang.srt.utils.network import NetworkAddress

    cfg = read_parallelism_config(device_id, device)
    # Ranks on node 0 share the host with the server (which may listen on
    # loopback only); others reach it at the rank-0 address.
    host = "127.0.0.1"
    if get_parallel().node_rank and get_parallel().dist_init_addr:
        host = NetworkAddress.parse(get_parallel().dist_init_addr).resolved().host
    url = f"{NetworkAddress(host, get_model().engine_info_bootstrap_port).to_url()}/register_parallelism_config"
    try:
        resp = requests.put(url, json=cfg, timeout=10)
        resp.raise_for_status()
    except Exception as e:
        logger.error("Failed to register parallelism config of rank %s at %s: %s", cfg["rank"], url, e)
        return False
    logger.info("Registered parallelism config of rank %s with %s", cfg["rank"], url)
    return True


class ParallelismConfigStore:
    """The registered configs of one engine (held by its bootstrap server).

    The newest store of the process is also :func:`current_store`: the
    engine's main HTTP server (same process) serves the same records.
    """

    def __init__(self):
        global _CURRENT
        self._lock = threading.Lock()
        self._by_rank: Dict[int, Dict[str, Any]] = {}
        _CURRENT = self

    def put(self, cfg: Dict[str, Any]) -> int:
        for key in ("tp_rank", "tp_size"):
            if key not in cfg:
                raise KeyError(key)
        rank = int(cfg["rank"]) if "rank" in cfg else global_rank_of(cfg)
        with self._lock:
            self._by_rank[rank] = dict(cfg, rank=rank)
        return rank

    def get(self, rank: int) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self._by_rank.get(rank)

    def all(self) -> Dict[int, Dict[str, Any]]:
        with self._lock:
            return dict(self._by_rank)


_CURRENT: Optional[ParallelismConfigStore] = None


def current_store() -> Optional[ParallelismConfigStore]:
    """The store of this process's engine-info bootstrap server, if any."""
    return _CURRENT


def install_parallelism_config_routes(app, store: ParallelismConfigStore) -> None:
    """PUT /register_parallelism_config and GET /parallelism_config (the
    bootstrap server)."""
    from fastapi import HTTPException
    from fastapi.responses import PlainTextResponse

    @app.put("/register_parallelism_config")
    def register_parallelism_config_route(data: dict):
        try:
            rank = store.put(data)
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPException(status_code=400, detail=f"bad parallelism config: {e}")
        logger.info("Registered parallelism config for rank=%s", rank)
        return PlainTextResponse("OK")

    install_parallelism_config_read_route(app, lambda: store)


def install_parallelism_config_read_route(
    app, get_store: Callable[[], Optional[ParallelismConfigStore]]
) -> None:
    """GET /parallelism_config[?rank=R] from ``get_store()`` (the bootstrap
    server's own store, or on the engine's HTTP port :func:`current_store`)."""
    from fastapi import HTTPException

    @app.get("/parallelism_config")
    def get_parallelism_config(rank: Optional[int] = None):
        store = get_store()
        if store is None:
            raise HTTPException(
                status_code=404,
                detail="this engine registers no parallelism configs; start it with "
                "--enable-rdt-weight-sync or --enable-engine-info-bootstrap",
            )
        if rank is None:
            return {"ranks": {str(r): c for r, c in sorted(store.all().items())}}
        if rank < 0:
            raise HTTPException(status_code=400, detail="Invalid rank parameter")
        cfg = store.get(rank)
        if cfg is None:
            raise HTTPException(
                status_code=404,
                detail=f"No parallelism config for rank {rank}; registered ranks: "
                f"{sorted(store.all())}",
            )
        return cfg
