#!/usr/bin/env python3
"""The fixed cost of one ``SchedulerActor.pull_weights`` call in a live engine.

A trainer calls ``pull_weights`` once per bucket per rank, every update, so
what one call costs regardless of its bytes multiplies. This measures it
against a real ``python -m sglang.launch_server --backend ray
--enable-rdt-weight-sync`` server: generation paused as miles does it
(``/pause_generation {"mode": "retract"}``, ``/flush_cache``,
``/begin_weight_update``), then many calls, each pulling a fresh NIXL ref of
tiny tensors (default: one 256-byte parameter) put by a trainer actor shaped
like miles' (one registered bucket, views put with
``ray.put(views, _tensor_transport="nixl")``). The update is ended and
generation continued afterwards.

Next to every pull it times two calls to the same actor that do no weight
work: ``__ray_ready__`` (Ray's built-in no-op method) and
``get_weight_sync_status`` (a plain method of ours). It prints p50/p90 of
each, and the pull split into stages, from what the rank returns
(``pull_weights``' ``plan_seconds``, ``fetch_seconds`` and ``timing``; all
stamps are ``time.perf_counter()``, one monotonic clock for every process of
the host):

==================  ========================================================
dispatch            the caller's ``.remote()`` until the actor method queued
                    the pull for the scheduler thread (Ray's call path)
safe-point pickup   queued until the scheduler loop started the task (a
                    paused loop waits at its safe point and wakes for it)
quiesce check       the rank's check that generation is paused and no batch
                    runs, until the receiver started
plan                the refs' metadata (shapes, dtypes), names → live
                    parameters with their checks, NIXL registrations, the
                    update state's admission of the writer
transfer            the read: same-node (``process_vm_readv``, CUDA IPC) for
                    an ``SGLANG_IPC`` ref this rank can read, else
                    ``set_target_for_ref`` + ``ray.get`` (NIXL)
record              the update state's record of the pull, its log line
safe-point handoff  the task finished until the actor thread had it back
reply               the actor thread's return until the caller had the
                    result (Ray's return path)
==================  ========================================================

Examples::

    # Everything itself: a private Ray head, the test suite's tiny Llama,
    # a CPU server (~40 s to start on a 2-core box), 300 calls
    python benchmark/rdt_weight_sync/bench_call_cost.py --calls 300
    # Against a running server (its Ray cluster in RAY_ADDRESS, with
    # RAY_AUTH_MODE=token and its token; --namespace: its --ray-namespace)
    python benchmark/rdt_weight_sync/bench_call_cost.py --url http://127.0.0.1:30000 \\
        --namespace sglang --calls 300

It overwrites the pulled parameters with their own bytes' worth of ones (RMSNorm
weights of the tiny model start as ones). Numbers go to ``--json-out``
(default ``$OUT/bench_call_cost.json`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from call_cost_parts import OwnServer, find_rank, make_trainer, post  # noqa: E402

# The rank's stages, in the order they happen (see the module docstring).
RANK_STAGES = ["plan", "transfer", "record"]
ROWS = ["dispatch", "safe-point pickup", "quiesce check", *RANK_STAGES,
        "safe-point handoff", "reply"]


def pct(values: List[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def split(out: Dict[str, Any], t_send: float, t_recv: float) -> Dict[str, float]:
    """One pull's wall time split into the rows above (seconds)."""
    tm = out["timing"]
    receiver = tm["pull_end"] - tm["pull_start"]
    row = {
        "dispatch": tm["queued"] - t_send,
        "safe-point pickup": tm["started"] - tm["queued"],
        "quiesce check": tm["pull_start"] - tm["started"],
        "plan": out["plan_seconds"],
        "transfer": out["fetch_seconds"],
        "record": receiver - out["plan_seconds"] - out["fetch_seconds"],
        "safe-point handoff": tm["resumed"] - tm["finished"],
        "reply": t_recv - tm["resumed"],
    }
    # What the stages above do not cover inside the task (the receiver's
    # lock, the task's return): shown so nothing is hidden.
    row["rest of task"] = (tm["finished"] - tm["started"]) - row["quiesce check"] - receiver
    row["total"] = t_recv - t_send
    return row


def read_paths(out: Dict[str, Any]) -> List[str]:
    """How each source of one pull was read: ``path/method`` (e.g. ``cma/process_vm_readv``)."""
    return [f"{r['path']}/{r['method']}" for r in out.get("reads", [])]


def measure(args, url: str, log=print) -> Dict[str, Any]:
    import ray

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=args.namespace,
                 log_to_driver=False, logging_level="ERROR")
    rank, actor_name = find_rank(ray, port, args.namespace)
    reg = ray.get(rank.register_weight_for_rdt.remote(), timeout=120)
    layout = ray.get(rank.get_parameter_layout.remote(), timeout=60)
    import torch

    def nbytes(n: str) -> int:
        dtype = getattr(torch, layout[n]["dtype"])
        return math.prod(layout[n]["shape"]) * torch.empty(0, dtype=dtype).element_size()

    names = sorted(layout, key=lambda n: (abs(nbytes(n) - args.bytes), n))[: args.tensors]
    shapes = [layout[n]["shape"] for n in names]
    dtypes = [layout[n]["dtype"] for n in names]
    if args.transport == "SGLANG_IPC":
        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()  # before the actors that use it are created
    trainer = make_trainer(ray).remote(shapes, dtypes, args.transport)
    ray.get(trainer.put.remote(), timeout=120)

    def begin() -> None:
        post(url, "/pause_generation", {"mode": args.pause_mode})
        if args.pause_mode != "in_place":
            requests.get(f"{url}/flush_cache", timeout=60).raise_for_status()
        post(url, "/begin_weight_update", {"selector": "all"})

    def end(version: str) -> None:
        post(url, "/update_weight_version", {"new_version": version})
        r = requests.post(f"{url}/end_weight_update", json={}, timeout=120)
        post(url, "/continue_generation")
        if r.status_code != 200 or not r.json().get("success"):
            raise SystemExit(f"the update did not end cleanly: {r.status_code} {r.text}")

    rows: List[Dict[str, float]] = []
    noop: List[float] = []
    status_call: List[float] = []
    reused: List[bool] = []
    paths: Dict[str, int] = {}
    first: Dict[str, Any] = {}
    clock = time.perf_counter
    updates = 1

    def driver_calls(n: int):
        out_rows = []
        for _ in range(n):
            (ref,) = ray.get(trainer.put.remote(), timeout=60)
            t0 = clock()
            ray.get(rank.__ray_ready__.remote(), timeout=60)
            t1 = clock()
            ray.get(rank.get_weight_sync_status.remote(), timeout=60)
            t2 = clock()
            out = ray.get(rank.pull_weights.remote([ref], names), timeout=120)
            t3 = clock()
            del ref
            out_rows.append((t0, t1, t2, t2, t3, out))
        return out_rows

    def calls(n: int):
        if args.caller == "driver":  # a borrower of the ref sends it
            return driver_calls(n)
        return ray.get(trainer.calls.remote(rank, names, n), timeout=120 + 5 * n)

    # Calls in segments: the warm-up, then one segment per update.
    total = args.warmup + args.calls
    per = args.calls_per_update or args.calls
    segments = [args.warmup] if args.warmup else []
    left = args.calls
    while left > 0:
        segments.append(min(per, left))
        left -= segments[-1]
    begin()
    try:
        done = []
        for k, n in enumerate(segments):
            if args.calls_per_update and k > (1 if args.warmup else 0):
                end(f"call-cost-{os.getpid()}-{updates}")  # miles: one update per round of buckets
                begin()
                updates += 1
            done += calls(n)
        assert len(done) == total
        for i, (t0, t1, t1b, t2, t3, out) in enumerate(done):
            if i == 0:
                first = {"total_ms": (t3 - t2) * 1e3,
                         "stages_ms": {k: v * 1e3 for k, v in split(out, t2, t3).items()}}
            if i < args.warmup:
                continue
            noop.append(t1 - t0)
            status_call.append(t1b - t1)
            rows.append(split(out, t2, t3))
            reused.append(bool(out.get("plan_reused")))
            for p in read_paths(out):
                paths[p] = paths.get(p, 0) + 1
    finally:
        try:
            end(f"call-cost-{os.getpid()}-{updates}")
        finally:
            ray.kill(trainer)

    def summary(values: List[float]) -> Dict[str, float]:
        return {"p50_ms": pct(values, 50) * 1e3, "p90_ms": pct(values, 90) * 1e3,
                "mean_ms": statistics.fmean(values) * 1e3}

    keys = [*ROWS, "rest of task", "total"]
    return {
        "url": url,
        "actor": actor_name,
        "calls": args.calls,
        "warmup": args.warmup,
        "tensors": len(names),
        "names": names,
        "bytes": sum(nbytes(n) for n in names),
        "transport": args.transport,
        "caller": args.caller,
        "pause_mode": args.pause_mode,
        "updates": updates,
        "plan_reused": sum(reused) / max(1, len(reused)),
        "paths": paths,
        "registered": reg.get("registered"),
        "first_call": first,
        "noop": summary(noop),
        "status_call": summary(status_call),
        "pull": {k: summary([r[k] for r in rows]) for k in keys},
        "load_average": os.getloadavg(),
    }


def print_table(res: Dict[str, Any], target: float) -> None:
    pull, noop, status = res["pull"], res["noop"], res["status_call"]
    print()
    print(f"pull_weights of {res['tensors']} tensor(s), {res['bytes']} bytes put over {res['transport']}, "
          f"{res['calls']} calls from the {res.get('caller', 'driver')} after {res['warmup']} warm-up, "
          f"{res['updates']} update(s), "
          f"plan reused in {res['plan_reused']:.0%}; read as "
          + ", ".join(f"{p} x{n}" for p, n in sorted(res["paths"].items()))
          + "; load average " + " ".join(f"{x:.1f}" for x in res["load_average"]))
    print(f"{'':28s}{'p50 ms':>9s}{'p90 ms':>9s}{'mean ms':>9s}")
    for label, s in (("no-op call (__ray_ready__)", noop),
                     ("get_weight_sync_status", status),
                     ("pull_weights, whole call", pull["total"])):
        print(f"{label:28s}{s['p50_ms']:9.3f}{s['p90_ms']:9.3f}{s['mean_ms']:9.3f}")
    print("  stages of pull_weights:")
    for k in [*ROWS, "rest of task"]:
        s = pull[k]
        print(f"    {k:24s}{s['p50_ms']:9.3f}{s['p90_ms']:9.3f}{s['mean_ms']:9.3f}")
    ratio = pull["total"]["p50_ms"] / noop["p50_ms"]
    ratio_status = pull["total"]["p50_ms"] / status["p50_ms"]
    res["ratio_p50_vs_noop"] = ratio
    res["ratio_p50_vs_status"] = ratio_status
    print(f"pull p50 / no-op p50: {ratio:.2f}x; / get_weight_sync_status p50: {ratio_status:.2f}x "
          f"(target <= {target:g}x: {'met' if ratio <= target else 'NOT met'})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (else one is started here)")
    p.add_argument("--namespace", default=None,
                   help="its --ray-namespace (default: any namespace)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--tensors", type=int, default=1, help="parameters per pull")
    p.add_argument("--bytes", type=int, default=256,
                   help="pick the parameters closest to this size")
    p.add_argument("--pause-mode", default="retract", choices=["abort", "retract", "in_place"])
    p.add_argument("--calls-per-update", type=int, default=0,
                   help="end the update and begin a new one after this many calls, as a "
                        "trainer does every step (default: all calls in one update)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for the server started here (repeat)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the Ray head started here, so of every actor "
                        "(e.g. UCX_TLS=cma,tcp,self; repeat)")
    p.add_argument("--transport", default="nixl", choices=["nixl", "SGLANG_IPC"],
                   help="how the trainer puts (SGLANG_IPC: the same-node path, read without ray.get)")
    p.add_argument("--caller", default="driver", choices=["driver", "trainer"],
                   help="who sends the calls: this driver, a borrower of the ref (default), "
                        "or the trainer actor that put it, right after its put (miles' own "
                        "shape)")
    p.add_argument("--target", type=float, default=2.0, help="p50 ratio to the no-op call")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.env and args.url:
        p.error("--env applies to the Ray head started here, not to --url's")

    own = None
    url = args.url
    try:
        if url is None:
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ.update(dict(kv.split("=", 1) for kv in args.env))
            own = OwnServer(args.server_arg)
            url = own.start()
            args.namespace = own.head.namespace
        res = measure(args, url)
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            if own is not None:
                own.stop()
    res["env"] = args.env
    print_table(res, args.target)
    out = args.json_out or (os.path.join(os.environ["OUT"], "bench_call_cost.json")
                            if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
