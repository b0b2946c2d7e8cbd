"""Which Ray cluster, namespace and resources the Ray backend uses.

Upstream's Ray backend never calls ``ray.init()``: the first Ray call then starts
a fresh local cluster in an anonymous namespace, so actors land somewhere no
trainer can find them. This module makes that decision explicit and logged:

* a process that already has a Ray context (a driver that called ``ray.init``,
  or an actor) keeps it;
* otherwise ``--ray-address`` or ``RAY_ADDRESS`` names the cluster to join,
  with ``--ray-namespace`` and the caller's runtime env;
* otherwise a local cluster is started, and the log says so.

It also holds the device-dependent resource shapes (a CPU host has no GPU to
put in a placement-group bundle) and bounded waits for placement.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import ray

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayConnection:
    address: str
    namespace: str
    how: str  # "existing" | "connected" | "local"

    def describe(self) -> str:
        what = {
            "existing": "using this process's Ray context",
            "connected": "connected to Ray cluster",
            "local": "started a local Ray cluster (no --ray-address / RAY_ADDRESS)",
        }[self.how]
        return f"{what} at {self.address}, namespace {self.namespace!r}"


def _current_connection(how: str) -> RayConnection:
    ctx = ray.get_runtime_context()
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # pragma: no cover - older Ray
        address = os.environ.get("RAY_ADDRESS", "?")
    return RayConnection(address=address, namespace=ctx.namespace, how=how)


def connect_ray(
    address: Optional[str] = None,
    namespace: Optional[str] = None,
    runtime_env: Optional[Dict[str, Any]] = None,
) -> RayConnection:
    """Make sure this process has a Ray context, and say which one.

    Args:
        address: cluster to join when there is no context yet; defaults to
            ``RAY_ADDRESS``. With neither, a local cluster is started.
        namespace: Ray namespace for the actors this process creates. When the
            process already has a context in another namespace, that is an
            error: named actors would land where callers do not look.
        runtime_env: runtime env for the job when this call connects.
    """
    if ray.is_initialized():
        conn = _current_connection("existing")
        if namespace and conn.namespace != namespace:
            raise RuntimeError(
                f"this process is already connected to Ray in namespace "
                f"{conn.namespace!r}, but --ray-namespace is {namespace!r}; "
                f"call ray.init(namespace={namespace!r}) or drop the flag"
            )
    else:
        address = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: Dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
        if runtime_env:
            kwargs["runtime_env"] = runtime_env
        if address:
            ray.init(address=address, **kwargs)
            conn = _current_connection("connected")
        else:
            ray.init(**kwargs)
            conn = _current_connection("local")
    logger.info("[Ray] %s", conn.describe())
    return conn


def connect_ray_for(server_args) -> RayConnection:
    """Connect with the flags and the caller's launch options (runtime env)."""
    from sglang.srt.ray.launch import current_launch_options

    return connect_ray(
        address=getattr(server_args, "ray_address", None),
        namespace=getattr(server_args, "ray_namespace", None),
        runtime_env=current_launch_options().runtime_env,
    )


# --------------------------------------------------------------------------- #
# Resources
# --------------------------------------------------------------------------- #
def uses_gpu(device: Optional[str]) -> bool:
    """Whether scheduler actors need a Ray ``GPU`` resource for this device."""
    return device in (None, "cuda")


def node_bundle(device: Optional[str], ranks_per_node: int) -> Dict[str, float]:
    """The auto placement group's bundle for one node."""
    if uses_gpu(device):
        return {"CPU": 1, "GPU": ranks_per_node}
    # Off GPU, every rank still needs a place to run: one CPU per rank.
    return {"CPU": max(1, ranks_per_node)}


def rank_bundle(device: Optional[str]) -> Dict[str, float]:
    """One rank's bundle in a per-rank placement group."""
    return {"CPU": 1, "GPU": 1} if uses_gpu(device) else {"CPU": 1}


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it


def create_rank_placement_group(device: Optional[str], world_size: int, strategy: str, timeout_s: float):
    """The engine's own group for ``--ray-placement-strategy``: one bundle per
    rank, placed with ``strategy``, bundle 0 on this process's node (rank 0
    stays with the engine's HTTP server and tokenizer). Rank ``r`` goes on
    bundle ``r``, as with a caller's group; ``STRICT_SPREAD`` therefore puts
    every rank on its own Ray node (and needs as many nodes as ranks).

    Waits up to ``timeout_s`` for placement; removes the group if it fails.
    """
    from ray.util.placement_group import placement_group

    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"--ray-placement-strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")
    here = ray.get_runtime_context().get_node_id()
    pg = placement_group(
        [rank_bundle(device)] * world_size,
        strategy=strategy,
        bundle_label_selector=[{NODE_ID_LABEL: here}] + [{}] * (world_size - 1),
    )
    try:
        what = f"{world_size} rank bundles with strategy {strategy}"
        if strategy == "STRICT_SPREAD":
            what += f" (one Ray node per rank: {world_size} nodes, the first the launching one)"
        wait_placement_group(pg, timeout_s, what)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    logger.info(
        "[Ray] placement group %s: %d rank bundles, %s, on nodes %s",
        pg.id.hex()[:8], world_size, strategy,
        [n[:8] for _, n in sorted(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).items())],
    )
    return pg


def actor_resources(device: Optional[str]) -> Dict[str, float]:
    """``num_cpus`` / ``num_gpus`` for one scheduler actor inside its bundle."""
    return {"num_cpus": 0, "num_gpus": 1 if uses_gpu(device) else 0}


def count_rank_bundles(bundle_specs, device: Optional[str]) -> int:
    """How many ranks a caller-supplied placement group can hold."""
    if uses_gpu(device):
        for bundle in bundle_specs:
            if bundle.get("GPU", 0) > 1:
                raise ValueError(
                    "Custom placement group must have exactly 1 GPU per bundle. "
                    f"Found bundle with {bundle.get('GPU')} GPUs."
                )
        return sum(1 for b in bundle_specs if b.get("GPU", 0) > 0)
    return sum(1 for b in bundle_specs if b.get("CPU", 0) > 0)


def wait_placement_group(pg, timeout_s: float, what: str) -> None:
    """Wait for ``pg`` to be placed, or fail with what the cluster lacks."""
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        ray.get(ready[0])
        return
    try:
        available = ray.available_resources()
        total = ray.cluster_resources()
    except Exception:  # pragma: no cover - best effort for the message
        available, total = {}, {}
    raise RuntimeError(
        f"Ray could not place {what} within {timeout_s:.0f} s: it asks for "
        f"{pg.bundle_specs}, the cluster has {_fmt(total)} in total and "
        f"{_fmt(available)} free. Add resources, lower the parallelism, or "
        "raise --ray-startup-timeout."
    )


def _fmt(res: Dict[str, float]) -> str:
    parts = [f"CPU: {res.get('CPU', 0):g}", f"GPU: {res.get('GPU', 0):g}"]
    if "memory" in res:
        parts.append(f"memory: {res['memory'] / 2**30:.1f} GiB")
    return "{" + ", ".join(parts) + "}"
