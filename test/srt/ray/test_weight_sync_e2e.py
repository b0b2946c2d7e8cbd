"""RDT weight sync end to end: a real server (CLI), a trainer in another Ray job.

Every test of this file runs against the session's shared weight-sync server
(``rdt_server``: ``--enable-rdt-weight-sync`` in a namespace of its own, not
the driver's, and ``--sleep-on-idle``, an idle loop that sleeps in a poll,
which weight-sync calls must wake). The tests that update it compare its
output with the weights they pushed, and the test that must change nothing
compares with what it served just before.

``run_trainer_job`` and ``server_actors`` are shared with the other end-to-end
modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import RDT_SERVER_NAMESPACE as NAMESPACE
from conftest import live_actors
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROMPT = "the quick brown fox"
SCHED_IDLE = 5  # Linux scheduling policy number (os.SCHED_IDLE)


def run_trainer_job(head, server, model, *, seed, version, dp_size=1, extra=()):
    """``trainer_job.py`` in a Ray job of its own against ``server`` (found in
    the namespace its command line names); returns the job's RESULT."""
    namespace = server.arg("--ray-namespace") or head.namespace
    proc = subprocess.run(
        [sys.executable, str(HERE / "trainer_job.py"), "--address", head.address,
         "--namespace", namespace, "--port", str(server.port), "--model", str(model),
         "--seed", str(seed), "--version", version, "--dp-size", str(dp_size), *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, **head.env},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def server_actors(ray, server):
    """The live SchedulerActors of ``server`` (a CLI server's actor names carry its port)."""
    return [a for a in live_actors(ray) if f"_port{server.port}_" in a["Name"]]


def threads_with_policy(pid: int, policy: int):
    """Thread ids of process ``pid`` whose scheduling policy is ``policy``."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        # /proc/PID/stat field 41 is the policy; fields after the ")" start at 3.
        if int(stat[stat.rindex(b")") + 2:].split()[41 - 3]) == policy:
            out.append(int(tid))
    return out


@pytest.fixture
def server(rdt_server):
    return rdt_server


def test_engine_actors_are_detached_discoverable_and_live_in_the_requested_namespace_only(
    server, ray_client, ray_head
):
    (actor,) = server_actors(ray_client, server)
    # Discoverable: detached, named by node/port/rank, no placement-group hex.
    assert actor["IsDetached"] is True
    assert actor["Name"].endswith(f"_port{server.port}_dp0_pp0_tp0_bundle0")
    assert "_pg" not in actor["Name"]
    assert ray_client.get_actor(actor["Name"], namespace=NAMESPACE)
    with pytest.raises(ValueError):
        ray_client.get_actor(actor["Name"], namespace=ray_head.namespace)
    assert f"namespace '{NAMESPACE}'" in server.log()


def test_pull_without_quiescing_is_refused_and_changes_nothing(server, tiny_model, ray_head):
    before = server.output_ids(PROMPT, 12)
    with pytest.raises(AssertionError) as e:
        run_trainer_job(ray_head, server, tiny_model, seed=3, version="x", extra=["--no-session"])
    assert "refusing to pull weights while generation may run" in str(e.value)
    assert server.output_ids(PROMPT, 12) == before
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert (status["weights_consistent"], status["update_open"]) == (True, False)


def test_cross_job_pull_updates_live_params_in_place(server, tiny_model, ray_head, ray_client):
    old_ref = server.output_ids(PROMPT, 16)  # (whatever version it serves now)
    (actor,) = server_actors(ray_client, server)

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
    assert out["status"][0]["idle_sleep"] == "wakes on weight-sync calls"

    new_ref = hf_greedy(tiny_model, PROMPT, 16, random_state_dict(tiny_model, 1))
    assert new_ref != old_ref
    res = server.generate(PROMPT, 16)
    assert res["output_ids"] == new_ref
    assert res["meta_info"]["weight_version"] == "step-1"
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert status["weights_consistent"] is True and status["weight_version"] == "step-1"
    assert status["update_open"] is False

    # A second update on the same server, from another job.
    out2 = run_trainer_job(ray_head, server, tiny_model, seed=2, version="step-2")
    assert out2["job_id"] != out["job_id"]
    assert out2["ptr_after"] == out["ptr_before"]
    assert server.output_ids(PROMPT, 16) == hf_greedy(
        tiny_model, PROMPT, 16, random_state_dict(tiny_model, 2)
    )


def test_rank_runs_its_nixl_progress_thread_at_idle_priority(server, ray_client):
    """NIXL's progress thread polls without sleeping; the rank's agent (made
    when it registers) has it at SCHED_IDLE, so it takes no core from the
    engine for the rank's lifetime."""
    (actor,) = server_actors(ray_client, server)
    rank = ray_client.get_actor(actor["Name"], namespace=NAMESPACE)
    assert ray_client.get(rank.register_weight_for_rdt.remote(), timeout=120)["registered"] is True
    assert threads_with_policy(actor["Pid"], SCHED_IDLE), "no thread of the rank runs at SCHED_IDLE"
