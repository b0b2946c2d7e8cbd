"""Finding a running engine's ranks (named by its URL, or by rebuilt actor names) and calling its HTTP server."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

from sglang.srt.ray.actor_naming import get_scheduler_actor_name
from sglang.srt.ray.rdt.errors import WeightSyncError

logger = logging.getLogger(__name__)

BundleIndex = Union[int, Callable[[int, int, int], int]]
_ANY_ADDRESS = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "")
API_KEY_ENV = "SGLANG_RDT_API_KEY"
KEY_HELP = ("weight updates need the engine's --admin-api-key when it has one, else its --api-key: pass "
            f"api_key= to the client (or set {API_KEY_ENV})")


def default_api_key(api_key: Optional[str]) -> Optional[str]:
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def http(method: str, url: str, path: str, api_key: Optional[str], timeout_s: float, body=None):
    """``method url+path`` with the key as a Bearer token; the JSON answer, or
    a :class:`WeightSyncError` that says what failed (and which key a refusal needs)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = requests.request(method, f"{url}{path}", json=body, headers=headers, timeout=timeout_s)
    except requests.RequestException as e:
        raise WeightSyncError(f"{method} {url}{path} failed: {e}") from e
    try:
        data = r.json()
    except ValueError:
        data = {"success": False, "message": r.text[:500]}
    if r.status_code in (401, 403):
        raise WeightSyncError(f"{method} {url}{path} -> HTTP {r.status_code}: the engine refused "
                              f"{'this key' if api_key else 'a call without a key'}; {KEY_HELP}")
    if r.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
        raise WeightSyncError(f"{method} {url}{path} -> HTTP {r.status_code}: "
                              f"{data.get('message', data) if isinstance(data, dict) else data}")
    return data


def find_ranks_by_url(url: str, api_key: Optional[str], timeout_s: float) -> Tuple[List[Any], List[str]]:
    """The engine's SchedulerActor handles and names, in global rank order, from ``GET /weight_sync/ranks``."""
    import ray

    ranks = http("GET", url, "/weight_sync/ranks", api_key, timeout_s)["ranks"]
    actors, names = [], []
    for r in ranks:
        try:
            actors.append(ray.get_actor(r["actor_name"], namespace=r["namespace"]))
        except ValueError:
            raise WeightSyncError(f"the engine at {url} names rank {r['rank']} {r['actor_name']!r} in "
                                  f"namespace {r['namespace']!r}, but this process does not see it: join "
                                  "the engine's Ray cluster (ray.init(address=...) or address=)") from None
        names.append(r["actor_name"])
    logger.info("[RDT] weight-sync client: %d ranks of the engine at %s (namespace %r)", len(actors), url,
                ranks[0]["namespace"] if ranks else None)
    return actors, names


@dataclass(frozen=True)
class RankInfo:
    """One engine rank as the client addresses it."""

    index: int
    actor: Any
    name: Optional[str] = None

    def label(self) -> str:
        return f"rank {self.index}" + (f" ({self.name})" if self.name else "")


def ensure_ray(address: Optional[str]) -> None:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``) unless connected already."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise WeightSyncError("this process is not connected to Ray: call ray.init(address=...) "
                              "first, or pass address= / set RAY_ADDRESS (and RAY_AUTH_MODE=token "
                              "for a head started with `ray start`)")
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")


def find_ranks(port: int, namespace: str, *, node_ip: Optional[str] = None, host: str = "127.0.0.1",
               dp_size: int = 1, tp_size: int = 1, pp_size: int = 1,
               bundle_index: BundleIndex = 0) -> Tuple[List[Any], List[str]]:
    """The engine's SchedulerActor handles and names, in global rank order, by their rebuilt actor names."""
    import ray

    if node_ip is None:
        node_ip = host if host not in _ANY_ADDRESS else ray.util.get_node_ip_address()
    actors, names = [], []
    for dp, pp, tp in itertools.product(range(dp_size), range(pp_size), range(tp_size)):
        bundle = bundle_index(dp, pp, tp) if callable(bundle_index) else bundle_index
        name = get_scheduler_actor_name(rank0_node_ip=node_ip, dp_rank=dp, pp_rank=pp, tp_rank=tp,
                                        port=port, bundle_idx=bundle)
        try:
            actors.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            raise WeightSyncError(not_found(name, namespace, port)) from None
        names.append(name)
    logger.info("[RDT] weight-sync client: %d ranks of the engine on port %d in namespace %r",
                len(actors), port, namespace)
    return actors, names


def not_found(name: str, namespace: str, port: int) -> str:
    """Why an actor name did not resolve, with the engine actors that do exist."""
    import ray

    try:
        listed = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # pragma: no cover
        listed = []
    same_port = sorted(f"{a['namespace']}/{a['name']}" for a in listed if f"_port{port}_" in a["name"])
    hint = (f" Actors of an engine on port {port}: {same_port[:8]}." if same_port
            else f" No actor of any engine on port {port} exists in this cluster.")
    return (f"no SchedulerActor named {name!r} in namespace {namespace!r}.{hint} Check that the engine runs with "
            "--backend ray --enable-rdt-weight-sync and --ray-namespace, that this process joined the same cluster, "
            "and the layout (dp/tp/pp sizes, node_ip of rank 0, bundle_index).")
