"""Smoke test of the weight-sync speed benchmark in its CPU mode.

``benchmark/rdt_weight_sync/bench_pull.py --device cpu`` runs the receiver's
real pull path (``RdtWeightReceiver`` in one Ray actor, NIXL over DRAM from a
sender actor) and the ``SGLANG_IPC`` transport's CPU path (process_vm_readv
from the sender's memory, with 1 and 2 reader threads), against memcpy, on the
session's Ray head. Tiny sizes: this
checks that the tool works and its byte check passes, not the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmark" / "rdt_weight_sync" / "bench_pull.py"


def test_bench_pull_cpu_mode_checks_bytes_and_prints_figures(ray_head, tmp_path):
    out = tmp_path / "bench_pull.json"
    env = {**os.environ, **ray_head.env}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--uniform", "8x1",
         "--steady", "2", "--reps", "2", "--json-out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT),
    )
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    assert "BYTE_CHECK: PASS" in proc.stdout, log

    res = json.loads(out.read_text())
    assert res["device"] == "cpu"
    w = res["workloads"]["uniform"]
    assert w["errors"] == {}, w["errors"]
    assert (w["tensors"], w["bytes"]) == (8, 8 * 2**20)
    assert w["pointers_unchanged"] is True  # pulled in place, no re-allocation

    pulls = w["pull"]  # cold + 2 steady, through RdtWeightReceiver.pull
    assert len(pulls) == 3
    for p in pulls:
        assert p["check"]["ok"], p["check"]
        assert p["bytes"] == 8 * 2**20 and p["tensors"] == 8
        assert p["fetch_seconds"] > 0 and p["transport"] == "nixl"
    assert pulls[0]["stages"]["load_remote_metadata"] > 0  # stage timers ran

    ipc = w["ipc"]  # same host, CPU tensors: read with process_vm_readv
    assert len(ipc) == 3 and all(p["check"]["ok"] for p in ipc)
    assert {p["transport"] for p in ipc} == {"SGLANG_IPC/cma"}
    assert ipc[0]["ipc"]["method"] == "process_vm_readv" and ipc[0]["ipc"]["bytes"] == 8 * 2**20
    assert w["ipc_config"]["streams"] == min(4, os.cpu_count())  # default reader threads
    variants = w["ipc_variants"]  # then 1 and 2 threads, where not the default
    assert set(variants) == {f"cma:{k}:cma" for k in (1, 2) if k != min(4, os.cpu_count())}
    assert all(p["check"]["ok"] and p["transport"] == "SGLANG_IPC/cma" for v in variants.values() for p in v)

    ceiling = w["ceiling"]
    assert ceiling["memcpy_per_tensor_1thread"]["seconds"] > 0

    # The printed table and stage breakdown.
    for text in ("memcpy per tensor 1thread", "pull, NIXL cold", "pull, NIXL steady",
                 "pull, SGLANG_IPC (process_vm_readv, 1 thr)",
                 "handshake: add_remote_agent", "copy: post transfer"):
        assert text in proc.stdout, text
