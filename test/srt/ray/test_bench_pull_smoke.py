"""Smoke test of the weight-sync benchmark (benchmark/rdt_weight_sync/bench_pull.py) in its CPU mode.

``--device cpu --workloads tiny`` runs the product's client (``WeightSyncClient``
in a trainer actor) updating the product's standalone rank (in a rank actor)
on the session's Ray head, for each trainer mode (``stable``, ``fresh``,
``stream``), next to in-process memcpy ceilings; the rank checks every byte of
every update. The smallest run the CLI offers (two updates per mode, one
repetition per ceiling): this checks that the tool works, that its byte check
passes and that it reports what it measured, not the figures.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmark" / "rdt_weight_sync" / "bench_pull.py"
MODES = ("stable", "fresh", "stream", "cat", "strided")


def test_bench_pull_cpu_mode_checks_bytes_and_prints_every_mode_with_its_ratio(ray_head, tmp_path):
    out = tmp_path / "bench_pull.json"
    env = {**os.environ, **ray_head.env}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--workloads", "tiny", "--modes", ",".join(MODES),
         "--rounds", "2", "--reps", "1", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT),
    )
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    lines = proc.stdout.splitlines()
    assert "BYTE_CHECK: PASS" in lines, log

    # The table: one row per trainer mode (columns found by their header), its
    # path, its whole update's time and its ratio to the ceiling as numbers,
    # and its bytes checked.
    assert "#### tiny: 34 tensors, 0.00 GiB (bf16); one-tensor copy" in proc.stdout, log
    rows = table(lines, "trainer")
    assert set(rows) == set(MODES), log
    for mode, row in rows.items():
        # CPU tensors: bucket slots that the rank reads over its lane with process_vm_readv
        assert row["path"].startswith("buckets (cma, "), (mode, row)  # (how much was gathered)
        assert re.fullmatch(r"[0-9]+\.[0-9] ms", row["whole update"]), (mode, row)
        assert re.fullmatch(r"\*\*[0-9]+\.[0-9]{2}x\*\*", row["ratio"]), (mode, row)
        assert row["bytes"] == "ok", (mode, row)
    out_text = proc.stdout
    assert re.search(r"^Copies in one process: memcpy, per-tensor loop, 1 thread [0-9]+ GB/s", out_text, re.M), log
    assert re.search(r"^Stream ceiling \(the generator \+ a copy_ loop in-process\): [0-9.]+ ms$", out_text, re.M), log
    # The targets, each met or not (figures of a loaded CPU box mean nothing).
    for mode in MODES:
        if mode in ("cat", "strided"):  # made outside the staging pool: the bound that matters
            assert re.search(rf"^tiny {mode}: [0-9.]+x >= 0\.45x: (met|NOT met)$", proc.stdout, re.M), log
        else:
            assert re.search(rf"^tiny {mode}: first [0-9.]+x median <= 1\.5x: (met|NOT met)$", proc.stdout, re.M), log

    # The results file behind the table.
    res = json.loads(out.read_text())
    assert res["meta"]["device"] == "cpu" and res["meta"]["rounds"] == 2
    w = res["workloads"]["tiny"]
    assert w["errors"] == {}, w["errors"]
    assert w["info"]["tensors"] == 34
    for mode in MODES:
        run = w["client"][mode]
        assert len(run["updates"]) == 2 and all(u["check"]["ok"] for u in run["updates"]), run["updates"]
        for u in run["updates"]:
            assert (u["path"], u["transport"], u["tensors"]) == ("buckets", "cma", 34), u
            assert u["lane_calls"] == u["steps"] >= 1, u  # one lane call per step (one rank)
            assert u["gathered_bytes"] >= u["bytes"], u  # gathered into the slots: nothing read in place
            # the calling thread over update(): CPU time within its wall time, switches counted
            th = u["trainer_thread"]
            assert 0 < th["cpu_seconds"] <= u["seconds"] + 1e-3, (th, u["seconds"])
            assert isinstance(th["waits"], int) and isinstance(th["preempted"], int), th
            assert th["waits"] >= 0 and th["preempted"] >= 0, th
        assert run["route"] == {"direct": False, "lanes": 1,
                                "why_not_direct": "host-memory tensors are read in place only with export='direct'"}
    # Each printed ratio is the mode's ceiling over its steady update's time
    # (the one-tensor memcpy; for the stream, the same generator copied in-process).
    for mode in MODES:
        ceiling = w["stream_ceiling" if mode == "stream" else "ceiling"]
        ceiling = ceiling["seconds"] if mode == "stream" else ceiling["one_tensor"]["seconds"]
        steady = statistics.median(u["seconds"] for u in w["client"][mode]["updates"][1:])
        assert ceiling > 0 and rows[mode]["ratio"] == f"**{ceiling / steady:.2f}x**", (mode, ceiling, steady)
        assert rows[mode]["whole update"] == f"{steady * 1e3:.1f} ms", (mode, steady)


def table(lines, first_column: str):
    """The Markdown table whose header starts with ``first_column``: ``{first cell: {header: cell}}``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    header = cells(lines[start])
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, cells(line)))
        assert len(row) == len(header), (header, line)
        rows[row[first_column]] = row
    return rows
