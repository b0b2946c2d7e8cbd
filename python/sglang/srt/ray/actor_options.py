"""Ray options for one SchedulerActor: resources, name, lifetime, concurrency.

Default mode keeps upstream's behaviour (placement-group keyed name, owned by
the launching job), except that resources follow the device: a ``--device cpu``
engine asks for no GPU, the launcher's ``SGLANG_*`` environment is
forwarded, and actors on the launcher's node share its Prometheus
multiprocess directory (so ``--enable-metrics`` shows the schedulers' metrics
on the server's ``/metrics``). With ``--enable-rdt-weight-sync`` (``rdt``) the actor serves weight
sync and, unless launched in handles mode (``launch_engine``), becomes
discoverable (``discoverable``) by trainers in other Ray jobs:

* ``name`` carries the HTTP port instead of the placement-group id, so a
  trainer rebuilds it (see :mod:`sglang.srt.ray.actor_naming`);
* ``lifetime="detached"`` so a trainer job's handles stay valid; the engine
  kills these actors itself on shutdown (see :mod:`sglang.srt.ray.lifecycle`);
* ``max_concurrency`` > 1 so ``pull_weights`` and other calls run while
  ``run_event_loop`` blocks the actor's first thread;
* ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so every GPU stays visible
  and the absolute id from ``get_accelerator_ids()`` stays valid.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sglang.srt.ray.actor_naming import get_scheduler_actor_name
from sglang.srt.ray.cluster import actor_resources
from sglang.srt.ray.lifecycle import OWNER_JOB_ENV

# run_event_loop holds one thread for the engine's lifetime; the others serve
# pull_weights, register_weight_for_rdt, finalize and status calls.
RDT_ACTOR_MAX_CONCURRENCY = 8
RDT_ACTOR_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
# Actors start from the cluster's raylet, not from the launching process, so
# they do not see its environment; forward sglang's own settings.
FORWARDED_ENV_PREFIXES = ("SGLANG_", "SGL_")


# sglang's metrics are prometheus_client in multiprocess mode: every process
# writes into this directory and the HTTP server's /metrics reads it. An actor
# on the server's node can join in (the scheduler's own metrics and the RDT
# ones then show up on /metrics); one on another node cannot see the directory.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def forwarded_env() -> Dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)
    }


def bundle_node_id(placement_group, bundle_index: int) -> Optional[str]:
    """The node id a (ready) placement group put ``bundle_index`` on."""
    try:
        table = ray.util.placement_group_table(placement_group)
        return table.get("bundles_to_node_id", {}).get(bundle_index)
    except Exception:
        return None


def metrics_env(placement_group, bundle_index: int) -> Dict[str, str]:
    """``PROMETHEUS_MULTIPROC_DIR`` for an actor on this process's node."""
    d = os.environ.get(METRICS_DIR_ENV)
    if not d:
        return {}
    here = ray.get_runtime_context().get_node_id()
    if bundle_node_id(placement_group, bundle_index) != here:
        return {}
    return {METRICS_DIR_ENV: d}


def scheduler_actor_options(
    *,
    device: Optional[str],
    placement_group,
    bundle_index: int,
    rank0_node_ip: str,
    dp_rank: Optional[int],
    pp_rank: int,
    tp_rank: int,
    http_port: int,
    rdt: bool,
    discoverable: bool,
) -> Dict[str, Any]:
    options: Dict[str, Any] = dict(
        actor_resources(device),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=bundle_index,
        ),
    )
    ranks = dict(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, bundle_idx=bundle_index)
    env_vars = forwarded_env()
    env_vars.update(metrics_env(placement_group, bundle_index))
    if rdt:
        env_vars.update(RDT_ACTOR_ENV)
        options["max_concurrency"] = RDT_ACTOR_MAX_CONCURRENCY
    if env_vars:
        options["runtime_env"] = {"env_vars": env_vars}
    if discoverable:
        options["name"] = get_scheduler_actor_name(rank0_node_ip=rank0_node_ip, port=http_port, **ranks)
        options["lifetime"] = "detached"
        # Detached actors outlive their job: they watch it and exit when it
        # is gone (sglang.srt.ray.lifecycle.watch_owner_job).
        env_vars[OWNER_JOB_ENV] = ray.get_runtime_context().get_job_id()
        options["runtime_env"] = {"env_vars": env_vars}
    else:
        options["name"] = get_scheduler_actor_name(
            rank0_node_ip=rank0_node_ip, placement_group_id=placement_group.id.hex(), **ranks
        )
    return options
