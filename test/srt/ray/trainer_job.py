"""A trainer in its own Ray job that pushes new weights into a running engine.

It uses only what a real trainer has: the cluster address, the engine's
namespace, HTTP port and layout. It rebuilds the SchedulerActor names, registers
their weights, reads each rank's parallelism config, puts the new weights in a
trainer actor over NIXL (several buckets) and pulls them inside an update
session, exactly like miles' call shape (``pull_weights.remote([ref], names)``).

    python trainer_job.py --address A --namespace N --port P --model DIR \
        --seed 1 --version v1 [--dp-size 2] [--buckets 2]

Prints one JSON line with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def job_parser() -> argparse.ArgumentParser:
    """The arguments every trainer job takes: where the engine is, what to send."""
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--version", default="v1")
    return p


def main() -> None:
    p = job_parser()
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--buckets", type=int, default=2)
    p.add_argument("--no-session", action="store_true", help="pull without begin/end")
    args = p.parse_args()

    import ray
    import requests
    import torch

    from sglang.srt.ray import get_scheduler_actor_name
    from tiny_model import random_state_dict

    ray.init(
        address=args.address,
        namespace=f"trainer-{os.getpid()}",
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": HERE}},
    )
    from rdt_actors import ToyTrainer

    out = {"job_id": ray.get_runtime_context().get_job_id()}
    ip = ray.util.get_node_ip_address()
    actors, names = [], []
    for dp in range(args.dp_size):
        name = get_scheduler_actor_name(
            ip, dp_rank=dp, pp_rank=0, tp_rank=0, bundle_index=0, port=args.port
        )
        names.append(name)
        actors.append(ray.get_actor(name, namespace=args.namespace))
    out["actor_names"] = names
    out["register"] = ray.get([a.register_weight_for_rdt.remote() for a in actors])
    out["parallelism"] = ray.get([a.get_parallelism_config.remote() for a in actors])
    layouts = ray.get([a.get_parameter_layout.remote() for a in actors])
    out["ptr_before"] = [{n: v["data_ptr"] for n, v in lay.items()} for lay in layouts]

    new = random_state_dict(args.model, args.seed)
    layout = layouts[0]
    ordered = [n for n in layout]  # the rank's own order
    tensors = {
        n: new[n].to(getattr(torch, layout[n]["dtype"])).contiguous() for n in ordered
    }
    chunks = [ordered[i :: args.buckets] for i in range(args.buckets)]
    trainer = ToyTrainer.remote()
    refs = [ray.get(trainer.put.remote([tensors[n] for n in chunk]))[0] for chunk in chunks]

    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    session = None
    if not args.no_session:
        r = requests.post(f"{url}/weight_sync/begin", json={"lease_s": 120}, timeout=150)
        r.raise_for_status()
        session = r.json()["session_id"]
    stats = []
    for ref, chunk in zip(refs, chunks):
        stats.append(ray.get([a.pull_weights.remote([ref], chunk) for a in actors]))
    if not args.no_session:
        r = requests.post(
            f"{url}/weight_sync/end",
            json={"weight_version": args.version, "session_id": session},
            timeout=150,
        )
        r.raise_for_status()
        out["end"] = r.json()
    out["seconds"] = time.perf_counter() - t0
    out["pull_stats"] = stats
    out["ptr_after"] = [
        {n: v["data_ptr"] for n, v in lay.items()}
        for lay in ray.get([a.get_parameter_layout.remote() for a in actors])
    ]
    out["status"] = ray.get([a.get_weight_sync_status.remote() for a in actors])
    ray.get(trainer.drop.remote())
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    main()
