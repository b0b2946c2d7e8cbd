"""A trainer job for an engine whose ranks sit on different Ray nodes.

It finds each rank by its rebuilt actor name (a DP group's name carries the IP
of the node of its first rank), asks every rank where Ray put it, and updates
all ranks with ``WeightSyncClient`` from a trainer actor pinned to one node
(``transport="auto"``, buckets in the trainer's process).

    python two_node_job.py --address A --namespace N --port P --model DIR \
        --rank-node-ips IP0,IP1 --trainer-node-ip IP --seed 1 --version v1

Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from trainer_job import job_parser  # noqa: E402


def main() -> None:
    p = job_parser()
    # "local": the node this job's driver (and the engine's launcher, started
    # on the same host from the same address) attached to.
    p.add_argument("--rank-node-ips", required=True, help="node IP of dp rank 0, 1, ... or 'local'")
    p.add_argument("--trainer-node-ip", required=True)
    args = p.parse_args()

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from sglang.srt.ray import get_scheduler_actor_name

    ray.init(
        address=args.address, namespace=f"trainer-{os.getpid()}",
        log_to_driver=False, logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": HERE}},
    )
    from client_actors import NodeTrainer

    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    local_ip = ray.util.get_node_ip_address()

    def node_ip(ip: str) -> str:
        return local_ip if ip == "local" else ip

    actors, names = [], []
    for dp, ip in enumerate(map(node_ip, args.rank_node_ips.split(","))):
        # Rank r of a --ray-placement-strategy engine is on bundle r.
        name = get_scheduler_actor_name(
            rank0_node_ip=ip, dp_rank=dp, pp_rank=0, tp_rank=0, port=args.port, bundle_idx=dp
        )
        names.append(name)
        actors.append(ray.get_actor(name, namespace=args.namespace))
    out = {
        "nodes": nodes,
        "local_ip": local_ip,
        "driver_node_id": ray.get_runtime_context().get_node_id(),
        "names": names,
        "placement": ray.get([a.get_ray_placement.remote() for a in actors], timeout=60),
    }
    trainer = NodeTrainer.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[node_ip(args.trainer_node_ip)], soft=False)
    ).remote()
    out["trainer"] = ray.get(trainer.update.remote(
        actors, names, f"http://127.0.0.1:{args.port}", args.model, args.seed, args.version,
    ), timeout=240)
    ray.kill(trainer)
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    main()
