"""The fixed cost of one ``pull_weights`` call against a live server, and a paused engine's loop.

Against a live ``--backend ray --enable-rdt-weight-sync`` CPU server (one for
the module): ``benchmark/rdt_weight_sync/bench_call_cost.py`` runs briefly and
reports every stage of a pull; the paused engine's scheduler loop waits at
its safe point every round instead of spinning. (The receiver's plan reuse is
tested in ``test_engine_plan.py``, the safe point's waits without a server in
``test_safe_point.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmark" / "rdt_weight_sync" / "bench_call_cost.py"


# --------------------------------------------------------------------------- #
# A live server: the benchmark, and a paused engine that sleeps
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def server(ray_head, tiny_model, tmp_path_factory):
    from conftest import start_server

    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace],
        tmp_path_factory.mktemp("call-cost-server"),
        idle_sleep=False,  # sglang's default idle loop: what the paused-loop test looks at
    )
    yield s
    s.terminate()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nixl", "SGLANG_IPC"])
def test_call_cost_bench_reports_every_stage_against_a_live_server(server, ray_head, tmp_path, transport):
    out = tmp_path / "bench_call_cost.json"
    env = {**os.environ, **ray_head.env}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--url", server.url, "--namespace", ray_head.namespace,
         "--calls", "8", "--warmup", "2", "--calls-per-update", "4", "--json-out", str(out),
         "--transport", transport],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT),
    )
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    res = json.loads(out.read_text())
    assert (res["calls"], res["tensors"], res["bytes"], res["transport"]) == (8, 1, 256, transport)
    assert res["updates"] == 2 and res["registered"] is True
    # Plans are reused within an update and across updates (same parameters).
    assert res["plan_reused"] == 1.0, res
    pull = res["pull"]
    for row in ("dispatch", "safe-point pickup", "quiesce check", "plan", "transfer", "record",
                "safe-point handoff", "reply"):
        assert pull[row]["p50_ms"] >= 0, row
        assert row in proc.stdout, row
    assert pull["transfer"]["p50_ms"] > 0 and pull["total"]["p50_ms"] > 0
    # NIXL refs are fetched by Ray; same-node SGLANG_IPC refs of CPU tensors
    # are read by the rank itself, with process_vm_readv.
    path = "nixl/nixl" if transport == "nixl" else "cma/process_vm_readv"
    assert res["paths"] == {path: 8}, res["paths"]
    assert f"read as {path} x8" in proc.stdout
    assert res["noop"]["p50_ms"] > 0 and res["status_call"]["p50_ms"] > 0
    assert "pull p50 / no-op p50" in proc.stdout
    # The bench ended its updates cleanly and the engine serves again.
    assert server.output_ids("the quick brown fox", 4)


@pytest.mark.slow
def test_paused_engine_loop_waits_every_round_instead_of_spinning(server, ray_client, ray_head):
    import requests

    ray = ray_client
    (name,) = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
               if f"_port{server.port}_" in e["name"]]
    rank = ray.get_actor(name, namespace=ray_head.namespace)

    def count_rounds(self):
        """(In the rank actor; pickled by value) count the scheduler loop's
        rounds — each passes the safe point once. Returns (rounds, idle waits)."""
        from sglang.srt.managers.scheduler_safe_point import safe_point_queue

        q = safe_point_queue(self.scheduler)
        if "run_pending" not in vars(q):
            counted = [0]
            run_pending = q.run_pending

            def counting(scheduler):
                counted[0] += 1
                return run_pending(scheduler)

            q.run_pending = counting
            q.counted_rounds = counted
        return q.counted_rounds[0], q.idle_waits

    def counts():
        return ray.get(rank.__ray_call__.remote(count_rounds), timeout=60)

    counts()
    # Serving and idle, the loop polls without waiting, round after round.
    r0, w0 = counts()
    wait_until(lambda: counts()[0] > r0 + 1000, 120, interval=0.05, what="the serving loop's rounds")
    assert counts()[1] == w0
    r = requests.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        wait_until(lambda: counts()[1] > w0, 60, interval=0.05, what="the paused loop's first wait")
        r1, w1 = counts()
        wait_until(lambda: counts()[1] >= w1 + 20, 120, interval=0.05, what="20 more idle waits")
        r2, w2 = counts()
    finally:
        requests.post(f"{server.url}/continue_generation", json={}, timeout=60)
    # Paused, the loop goes round only when a wait ended (a spinning loop,
    # and the Ray thread fighting it for the GIL, took about two cores).
    assert abs((r2 - r1) - (w2 - w1)) <= 1, (r2 - r1, w2 - w1)
    # Generation continued: it serves again without waiting.
    r3, w3 = counts()
    wait_until(lambda: counts()[0] > r3 + 1000, 120, interval=0.05, what="the serving loop's rounds")
    assert counts()[1] - w3 <= 1
    assert server.output_ids("the quick brown fox", 4)
