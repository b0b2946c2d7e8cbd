"""RDT weight sync end to end: a real server (CLI), a trainer in another Ray job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import live_actors
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROMPT = "the quick brown fox"


def run_trainer_job(head, server, model, *, seed, version, dp_size=1, extra=()):
    proc = subprocess.run(
        [sys.executable, str(HERE / "trainer_job.py"), "--address", head.address,
         "--namespace", head.namespace, "--port", str(server.port), "--model", str(model),
         "--seed", str(seed), "--version", version, "--dp-size", str(dp_size), *extra],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, **head.env},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_cross_job_pull_updates_live_params_in_place(launch_server, tiny_model, ray_head, ray_client):
    server = launch_server(
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace,
         # an idle loop that sleeps in a poll: weight-sync calls must wake it
         "--sleep-on-idle"]
    )
    old_ref = hf_greedy(tiny_model, PROMPT, 16)
    assert server.output_ids(PROMPT, 16) == old_ref

    # Discoverable: detached, named by node/port/rank, no placement-group hex.
    (actor,) = live_actors(ray_client)
    assert actor["IsDetached"] is True
    assert f"_port{server.port}_dp0_pp0_tp0_bundle0" in actor["Name"]
    assert "_pg" not in actor["Name"]

    out = run_trainer_job(ray_head, server, tiny_model, seed=1, version="step-1")
    assert out["actor_names"] == [actor["Name"]]
    assert out["register"][0]["registered"] is True
    cfg = out["parallelism"][0]
    assert (cfg["tp_rank"], cfg["tp_size"], cfg["dp_rank"], cfg["dp_size"], cfg["device"]) == (
        0, 1, 0, 1, "cpu")
    # Two buckets, every tensor pulled once, into the same storage (zero copy).
    assert len(out["pull_stats"]) == 2
    assert sum(s[0]["tensors"] for s in out["pull_stats"]) == len(out["ptr_before"][0])
    assert out["ptr_after"] == out["ptr_before"]
    assert out["status"][0]["weights_consistent"] is True
    # The rank's NIXL agent was made with a progress-thread delay: no core
    # spinning in the engine for the rest of its life.
    assert out["status"][0]["nixl_progress_thread"] == "sleeps up to 1000 us between UCX events"
    assert out["status"][0]["idle_sleep"] == "wakes on weight-sync calls"

    new_ref = hf_greedy(tiny_model, PROMPT, 16, random_state_dict(tiny_model, 1))
    assert new_ref != old_ref
    res = server.generate(PROMPT, 16)
    assert res["output_ids"] == new_ref
    assert res["meta_info"]["weight_version"] == "step-1"
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert status["weights_consistent"] is True and status["weight_version"] == "step-1"
    assert status["update_open"] is False

    # A second update on the same server.
    out2 = run_trainer_job(ray_head, server, tiny_model, seed=2, version="step-2")
    assert out2["ptr_after"] == out["ptr_before"]
    assert server.output_ids(PROMPT, 16) == hf_greedy(
        tiny_model, PROMPT, 16, random_state_dict(tiny_model, 2)
    )


def test_pull_without_quiescing_is_refused_and_changes_nothing(
    launch_server, tiny_model, ray_head
):
    server = launch_server(
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace]
    )
    before = server.output_ids(PROMPT, 12)
    with pytest.raises(AssertionError) as e:
        run_trainer_job(ray_head, server, tiny_model, seed=3, version="x", extra=["--no-session"])
    assert "refusing to pull weights while generation may run" in str(e.value)
    assert server.output_ids(PROMPT, 12) == before
