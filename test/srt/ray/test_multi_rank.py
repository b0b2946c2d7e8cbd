"""Several ranks on CPU: data parallelism through the Ray DP controller.

(--tp-size 2 cannot run on CPU in sglang 0.5.23: the scheduler dies creating a
NCCL communicator, "Expected a cuda device, but got: cpu".)
"""

from __future__ import annotations

import pytest
import requests

from test_weight_sync_e2e import PROMPT, run_trainer_job, server_actors
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow


def test_dp2_each_rank_found_configured_and_updated(launch_server, tiny_model, ray_head, ray_client):
    server = launch_server(
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace,
         "--dp-size", "2"],
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        # Each rank is pinned to one of the two cores: slow on a loaded box.
        timeout=600,
    )
    names = sorted(a["Name"] for a in server_actors(ray_client, server))
    assert len(names) == 2
    assert [f"_port{server.port}_dp{i}_pp0_tp0_" in n for i, n in enumerate(names)] == [True, True]

    # The bootstrap server serves every rank's config, per rank and all at once.
    boot = f"http://127.0.0.1:{server.arg('--engine-info-bootstrap-port')}"
    every = requests.get(f"{boot}/parallelism_config", timeout=10).json()["ranks"]
    assert sorted(every) == ["0", "1"]
    for r in (0, 1):
        cfg = requests.get(f"{boot}/parallelism_config", params={"rank": r}, timeout=10).json()
        assert (cfg["rank"], cfg["dp_rank"], cfg["dp_size"], cfg["tp_rank"], cfg["tp_size"]) == (
            r, r, 2, 0, 1)
        assert cfg["device"] == "cpu" and cfg["node_rank"] == 0
    missing = requests.get(f"{boot}/parallelism_config", params={"rank": 5}, timeout=10)
    assert missing.status_code == 404 and "registered ranks: [0, 1]" in missing.text

    out = run_trainer_job(ray_head, server, tiny_model, seed=4, version="dp-1", dp_size=2)
    assert [c["dp_rank"] for c in out["parallelism"]] == [0, 1]
    assert out["ptr_after"] == out["ptr_before"]
    assert all(s["weights_consistent"] and s["pulls"] == 2 for s in out["status"])
    expected = hf_greedy(tiny_model, PROMPT, 12, random_state_dict(tiny_model, 4))
    # Both ranks serve the new weights: several requests land on both.
    outs = [server.output_ids(PROMPT, 12) for _ in range(4)]
    assert outs == [expected] * 4
