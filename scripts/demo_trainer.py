"""The trainer of ``make demo``: its own Ray job, pushing weights with WeightSyncClient.

It is what an RL trainer does, in miniature: roll out on the engine (greedy
``/generate``), train a few steps, push the new weights into the running engine
(:class:`sglang.srt.ray.rdt.trainer.client.WeightSyncClient`), roll out again. The model
is the tiny local Llama of ``test/srt/ray/tiny_model.py``, trained on that
file's small corpus, so the engine's output turns from noise into the corpus.

    python scripts/demo_trainer.py --address 127.0.0.1:6379 --namespace demo \\
        --port 30000 --model /tmp/tiny-llama [--syncs 3]

Exits non-zero if an update fails or the engine's output after a sync is not
the trainer's own greedy output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "test" / "srt" / "ray"))

PROMPT = "the quick brown"
NEW_TOKENS = 12


def printable(text: str) -> str:
    return "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)


def bar(done: int, total: int, width: int = 20) -> str:
    full = round(width * done / total)
    return "[" + "#" * full + "." * (width - full) + "]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="training steps per sync")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bucket-kib", type=int, default=128)
    p.add_argument("--go-file", help="wait for this file before touching Ray or the engine")
    args = p.parse_args()

    # Everything slow to import or load comes first: scripts/demo.py starts
    # this process while the engine is still starting.
    import ray
    import requests
    import torch
    import transformers
    from transformers import AutoTokenizer

    from sglang.srt.ray.rdt.trainer.client import WeightSyncClient
    from tiny_model import CORPUS, load_hf

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tty = sys.stdout.isatty()
    url = f"http://127.0.0.1:{args.port}"

    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_hf(args.model).train()
    sentences = sorted(set(CORPUS))
    batch = tok(sentences, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if args.go_file:  # started early by scripts/demo.py: imports are done, wait for the engine
        parent, deadline = os.getppid(), time.monotonic() + 600
        while not os.path.exists(args.go_file):
            if os.getppid() != parent or time.monotonic() > deadline:
                return 2  # the demo is gone or gave up
            time.sleep(0.2)

    ray.init(address=args.address, namespace="demo-trainer", log_to_driver=False,
             logging_level="ERROR")
    print(f"  trainer: Ray job {ray.get_runtime_context().get_job_id()} "
          f"(pid {os.getpid()}), namespace 'demo-trainer'", flush=True)

    client = WeightSyncClient.connect(
        port=args.port, namespace=args.namespace, bucket_bytes=args.bucket_kib * 1024
    )
    reg = client.register()
    cfgs = client.parallelism_configs()
    for rank, cfg, r in zip(client.ranks, cfgs, reg):
        print(f"  found {rank.name} in namespace '{args.namespace}' "
              f"(tp {cfg['tp_rank']}/{cfg['tp_size']}, dp {cfg['dp_rank']}/{cfg['dp_size']}, "
              f"{cfg['device']}); {r.get('registrations')} parameter storages "
              f"NIXL-registered", flush=True)

    @torch.no_grad()
    def trainer_greedy():
        model.eval()
        ids = torch.tensor([tok(PROMPT)["input_ids"]])
        out = []
        for _ in range(NEW_TOKENS):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        model.train()
        return out

    def rollout():
        r = requests.post(f"{url}/generate", json={
            "text": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        }, timeout=60)
        r.raise_for_status()
        res = r.json()
        return res["output_ids"], printable(res["text"]), res["meta_info"].get("weight_version")

    def progress(bucket, done, total):
        line = (f"    {bar(done, total)} bucket {done}/{total}: {bucket.tensors} tensors, "
                f"{bucket.bytes / 1024:.1f} KiB, pulled by {bucket.ranks} rank(s) in "
                f"{bucket.pull_seconds * 1000:.1f} ms")
        if tty:
            print("\r" + line.ljust(100), end="" if done < total else "\n", flush=True)
        else:
            print(line, flush=True)

    mismatches = 0
    for i in range(1, args.syncs + 1):
        print(f"\n  sync {i}/{args.syncs}  prompt: {PROMPT!r}", flush=True)
        _, text, version = rollout()
        print(f"    before  weight_version={version:<8} {text!r}", flush=True)
        for _ in range(args.steps):
            loss = model(**batch, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"    trained {args.steps} steps, loss {loss.item():.3f}; pushing weights ...",
              flush=True)
        stats = client.update(
            dict(model.named_parameters()), version=f"v{i}", strict=True, progress=progress
        )
        print(f"    synced  {stats.tensors} tensors, {stats.bytes / 2**20:.2f} MiB in "
              f"{stats.transfer_seconds:.3f} s ({stats.gbps:.4f} GB/s) over "
              f"{len(stats.buckets)} buckets (transport={stats.transport}); whole update "
              f"incl. pause/finalize {stats.seconds:.3f} s", flush=True)
        ids, text, version = rollout()
        same = ids == trainer_greedy()
        mismatches += not same
        print(f"    after   weight_version={version:<8} {text!r}  "
              f"[{'same as the trainer model' if same else 'DIFFERS from the trainer model'}]",
              flush=True)

    client.close()
    ray.shutdown()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
