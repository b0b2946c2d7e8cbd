"""Smoke test of the weight-sync speed benchmark in its CPU mode.

``benchmark/rdt_weight_sync/bench_pull.py --device cpu`` runs the receiver's
real pull path (``RdtWeightReceiver`` in one Ray actor, NIXL over DRAM from a
sender actor) and the ``SGLANG_IPC`` transport's automatic fall-back to NIXL
(CPU tensors), against memcpy, on the session's Ray head. Tiny sizes: this
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

    ipc = w.get("ipc")
    if ipc is not None:  # the transport module is importable: CPU tensors go through NIXL
        assert all(p["check"]["ok"] for p in ipc)
        assert {p["transport"] for p in ipc} == {"SGLANG_IPC/nixl"}
        assert ipc[0]["ipc"]["reason"] == "tensors on cpu"

    ceiling = w["ceiling"]
    assert ceiling["memcpy_per_tensor_1thread"]["seconds"] > 0

    # The printed table and stage breakdown.
    for text in ("memcpy per tensor 1thread", "pull, NIXL cold", "pull, NIXL steady",
                 "handshake: add_remote_agent", "copy: post transfer"):
        assert text in proc.stdout, text
