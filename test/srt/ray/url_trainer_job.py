"""A trainer in its own Ray job that knows only the engine's URL and a key.

    python url_trainer_job.py --address A --url URL --api-key KEY --model DIR --seed 1 --version v1

It joins the cluster (its own namespace), finds the ranks with
``WeightSyncClient.connect(url=..., api_key=...)`` and pushes the weights of
seed ``--seed``. Prints one ``RESULT`` JSON line: what it found and did, or
the error the client raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--address", "--url", "--model", "--version"):
        p.add_argument(flag, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    import ray

    from sglang.srt.ray.rdt import WeightSyncClient
    from tiny_model import random_state_dict

    ray.init(address=args.address, namespace=f"url-trainer-{os.getpid()}", log_to_driver=False,
             logging_level="ERROR")
    try:
        with WeightSyncClient.connect(url=args.url, api_key=args.api_key) as client:
            client.register()
            stats = client.update(random_state_dict(args.model, args.seed), version=args.version, strict=True)
            out = {"ranks": [r.name for r in client.ranks], "tensors": stats.tensors,
                   "namespace": ray.get_runtime_context().namespace}
    except Exception as e:  # the test checks what a refused trainer is told
        out = {"error": type(e).__name__, "message": str(e)}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
