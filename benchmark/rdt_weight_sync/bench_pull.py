#!/usr/bin/env python3
"""Speed and memory of RDT weight sync on what trainers send, against what the hardware allows.

One run measures, for each workload (``workloads.py``: uniform, Qwen3-4B in
sglang's or Hugging Face's layout, MoE experts), the product's own client
(``WeightSyncClient``, in a trainer actor) updating the product's own rank
(``StandaloneRank``, in a rank actor) for each trainer mode
(``trainer.py``: ``stable``, ``fresh``, ``stream``, and variants), next to:

* the ceilings (``ceilings.py``): copies of the same bytes in one process;
  for ``stream`` the same generator consumed in-process by a ``copy_`` loop;
* the peer rows (CUDA): the same new tensors shared through PyTorch's CUDA IPC
  per tensor and in buckets (what colocated RL frameworks use today);
* miles' own loop (``--miles-rounds``): one registered bucket, put and pull
  per bucket, then finalize.

Every update's bytes are checked (the rank poisons its parameters first).
Results go to ``--json-out`` (default ``$OUT/bench_pull.json`` when ``OUT`` is
set); ``report.py`` prints the tables, the targets, and ``BYTE_CHECK: PASS``
or ``FAIL`` (exit status 1).

Examples::

    # one GPU, trainer and engine colocated (docs/performance.md)
    python benchmark/rdt_weight_sync/bench_pull.py --device cuda --same-gpu
    # CPU (the suite's smoke test): lanes + process_vm_readv and NIXL buckets, small
    python benchmark/rdt_weight_sync/bench_pull.py --device cpu --workloads tiny

It starts a local Ray unless ``RAY_ADDRESS`` names a cluster, and needs torch,
Ray (+ NIXL) and the fork's ``sglang.srt.ray.rdt`` (on a machine without
sglang's dependencies: ``device_tree.sh`` builds what to put on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import ray
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ceilings  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402
from rank import rank_actor  # noqa: E402
from trainer import BenchTrainer  # noqa: E402

MiB = 2**20


def parse_variant(text: str):
    """``mode[:key=value,...]`` -> (label, mode, client options)."""
    mode, _, rest = text.partition(":")
    opts: Dict[str, Any] = {}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=", 1)
        opts[k] = int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)
    return text, mode, opts


def run_workload(wname: str, args, log) -> Dict[str, Any]:
    specs, info = workloads.workload(wname, args)
    res: Dict[str, Any] = {"info": info, "client": {}, "peer": {}, "errors": {}}
    cuda = args.device == "cuda"
    log(f"[{wname}] {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB")

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # keep measuring the rest; the report shows it
            import traceback

            res["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            log(f"[{wname}] {name} FAILED: {res['errors'][name]}\n{traceback.format_exc()[-3000:]}")

    if not args.skip_ceiling:
        section("ceiling", lambda: res.__setitem__("ceiling", ceilings.cuda_ceilings(
            specs, 0, 0 if args.same_gpu else 1, args.reps) if cuda else ceilings.cpu_ceilings(specs, args.reps)))
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    env.update(dict(kv.split("=", 1) for kv in args.actor_env))
    if cuda:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    share = 0.5 if args.same_gpu else 1
    opts = {"runtime_env": {"env_vars": env}, **({"num_gpus": share} if cuda else {})}
    lora = (workloads.lora_adapter(workloads.QWEN3_4B if wname.startswith("qwen3-4b") else workloads.TINY,
                                   args.lora_rank, workloads.DTYPES[args.dtype])
            if args.lora_rounds and wname in ("qwen3-4b", "tiny") else None)
    rank = rank_actor(args.device, share).options(runtime_env=opts["runtime_env"]).remote(specs, args.device, lora)
    trainer = BenchTrainer.options(**opts).remote(specs, args.device)
    try:
        ray.get(rank.register_weight_for_rdt.remote(), timeout=600)
        res["placement"] = {"rank": ray.get(rank.where.remote())}
        bucket_bytes = int(args.bucket_mib * MiB)
        for j, text in enumerate(args.modes + args.variants):
            label, mode, copts = parse_variant(text)
            copts.setdefault("bucket_bytes", bucket_bytes)

            def client(label=label, mode=mode, copts=copts, j=j):
                out = ray.get(trainer.client_run.remote(rank, mode, copts, args.rounds, 1000 * (j + 1)),
                              timeout=1800)
                res["client"][label] = out
                ms = [round(u["seconds"] * 1e3, 1) for u in out["updates"]]
                ok = all(u["check"]["ok"] for u in out["updates"])
                log(f"[{wname}] client {label}: {out['updates'][-1]['path']} "
                    f"({out['updates'][-1]['transport']}) ms {ms} bytes_ok={ok}")

            section(f"client {label}", client)
        if "stream" in args.modes:
            section("stream ceiling", lambda: res.__setitem__(
                "stream_ceiling", ray.get(trainer.stream_ceiling.remote(args.reps), timeout=600)))
        if cuda:
            for k, kind in enumerate(args.peers):
                section(f"peer {kind}", lambda kind=kind, k=k: res["peer"].__setitem__(kind, ray.get(
                    trainer.peer_run.remote(rank, kind, bucket_bytes, args.rounds, 50000 + 1000 * k),
                    timeout=1800)))
        if lora:
            section("lora", lambda: res.__setitem__("lora", ray.get(trainer.lora_run.remote(
                rank, lora, args.lora_rounds, 70000), timeout=1800)))
        if args.miles_rounds:
            section("miles", lambda: res.__setitem__("miles", ray.get(trainer.miles_run.remote(
                rank, args.miles_transport, bucket_bytes, args.miles_rounds, 90000), timeout=1800)))
    finally:
        ray.kill(trainer)
        ray.kill(rank)
    return res


def git_revision() -> str:
    if os.environ.get("BENCH_REVISION"):  # a copy of the tree whose .git is not the source's
        return os.environ["BENCH_REVISION"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return os.environ.get("BENCH_REVISION", "unknown")


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--workloads", default=None, help="default: uniform,qwen3-4b,moe (cuda) / tiny (cpu)")
    ap.add_argument("--uniform", default=None, help="NxMiB, default 256x32 (cuda) / 16x1 (cpu)")
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--dtype", choices=list(workloads.DTYPES), default="bf16")
    ap.add_argument("--modes", default="stable,fresh,stream", help="trainer modes (trainer.py)")
    ap.add_argument("--variants", default="", help="more client rows, ';'-separated mode:key=value,... "
                    "(e.g. 'outside;cat;fresh:export=buckets;stable:transport=nixl')")
    ap.add_argument("--rounds", type=int, default=8, help="updates per client row (the first is cold)")
    ap.add_argument("--bucket-mib", type=float, default=None, help="group/slot size (1024 cuda / 4 cpu)")
    ap.add_argument("--peers", default="per_tensor,buckets", help="peer rows (cuda)")
    ap.add_argument("--miles-rounds", type=int, default=0)
    ap.add_argument("--miles-transport", default="SGLANG_IPC")
    ap.add_argument("--lora-rounds", type=int, default=0, help="adapter-only updates (qwen3-4b, tiny)")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each ceiling copy")
    ap.add_argument("--same-gpu", action="store_true", help="trainer and rank on one GPU")
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--actor-env", action="append", default=[], help="KEY=VALUE for the actors")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.workloads = (args.workloads or ("uniform,qwen3-4b,moe" if cuda else "tiny")).split(",")
    args.uniform = args.uniform or ("256x32" if cuda else "16x1")
    args.bucket_mib = args.bucket_mib or (1024 if cuda else 4)
    args.modes = [m for m in args.modes.split(",") if m]
    args.variants = [v for v in args.variants.split(";") if v]
    args.peers = [p for p in args.peers.split(",") if p]
    if cuda and not args.same_gpu and torch.cuda.device_count() < 2:
        raise SystemExit("two GPUs needed (or --same-gpu)")
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True, logging_level="ERROR")
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    meta = {"revision": git_revision(), "device": args.device, "same_gpu": args.same_gpu,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
            "ray": ray.__version__, "bucket_bytes": int(args.bucket_mib * MiB), "rounds": args.rounds,
            "argv": sys.argv[1:] if argv is None else argv, "date": time.strftime("%Y-%m-%d")}
    results = {"meta": meta, "workloads": {}}
    for wname in args.workloads:
        results["workloads"][wname] = run_workload(wname, args, log)
    path = args.json_out or (os.path.join(os.environ["OUT"], "bench_pull.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
    summary = report.summarize(results)
    print(report.markdown(summary, meta))
    for line in report.targets(summary):
        print(line)
    ok = report.byte_check(results) and not any(w["errors"] for w in results["workloads"].values())
    print("BYTE_CHECK:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
