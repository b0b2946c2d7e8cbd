"""One engine across two Ray nodes: placement, discovery by name, the path each rank's pull takes.

The cluster is its own (``ray_two_nodes``): a head and a worker joined to it
with node IP 127.0.0.2 — two raylets and two Ray node ids on one host, so the
hostname and the pid namespace are shared. One server from the CLI with
``--dp-size 2 --ray-placement-strategy STRICT_SPREAD``: rank r on bundle r,
bundle 0 on the launching node, bundle 1 on the other.

A trainer actor pinned to one node updates both ranks with
``WeightSyncClient(transport="auto")`` (bucket slots in the trainer's
process). The rank on the trainer's node must get its pulls over its
same-node call lane and read with ``process_vm_readv`` (``cma``), the other
must read the slots' refs over NIXL: the choice is made by Ray node id. A check by IP, hostname or
pid visibility would pick CMA for both here (same host, both pids visible).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import start_server
from test_weight_sync_e2e import PROMPT
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SAME_NODE = "cma"
OTHER_NODE = "nixl (the sender is on another node)"


@pytest.fixture(scope="module")
def two_node_server(ray_two_nodes, tiny_model, tmp_path_factory):
    head, _ = ray_two_nodes
    server = start_server(
        tiny_model, head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", head.namespace,
         "--dp-size", "2", "--ray-placement-strategy", "STRICT_SPREAD"],
        tmp_path_factory.mktemp("two-nodes"),
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        timeout=600,  # two ranks on a 2-core box shared with other work
    )
    yield server
    server.terminate()


def run_job(head, server, model, *, rank_node_ips, trainer_node_ip, seed, version) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "two_node_job.py"), "--address", head.address,
         "--namespace", head.namespace, "--port", str(server.port), "--model", str(model),
         "--rank-node-ips", ",".join(rank_node_ips), "--trainer-node-ip", trainer_node_ip,
         "--seed", str(seed), "--version", version],
        capture_output=True, text=True, timeout=400, env={**os.environ, **head.env},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def first_update(ray_two_nodes, two_node_server, tiny_model):
    """Ranks found by their per-node names; a trainer on the launching node
    updates both (seed 7)."""
    head, worker = ray_two_nodes
    return run_job(head, two_node_server, tiny_model, rank_node_ips=["local", worker.node_ip],
                   trainer_node_ip="local", seed=7, version="two-1")


def test_each_dp_rank_runs_on_its_own_node_and_is_found_by_its_nodes_name(
    ray_two_nodes, two_node_server, first_update
):
    _, worker = ray_two_nodes
    out, port = first_update, two_node_server.port
    nodes = out["nodes"]
    assert len(nodes) == 2 and worker.node_ip in nodes and out["local_ip"] in nodes
    head_node, worker_node = nodes[out["local_ip"]], nodes[worker.node_ip]
    assert head_node != worker_node and out["driver_node_id"] == head_node
    # Rank 0 with the launcher (its node's IP in the name), rank 1 on the
    # worker node (the IP of that node in its name); one group, one bundle each.
    assert out["names"] == [
        f"sglang_scheduler_node{out['local_ip']}_port{port}_dp0_pp0_tp0_bundle0",
        f"sglang_scheduler_node{worker.node_ip}_port{port}_dp1_pp0_tp0_bundle1",
    ]
    placement = out["placement"]
    assert [p["node_id"] for p in placement] == [head_node, worker_node]
    assert [p["actor_name"] for p in placement] == out["names"]
    assert placement[0]["placement_group_id"] == placement[1]["placement_group_id"] is not None
    # Each rank registered its config with the bootstrap server on node 0.
    cfgs = requests.get(f"{two_node_server.url}/parallelism_config", timeout=10).json()["ranks"]
    assert sorted((c["dp_rank"], c["dp_size"]) for c in cfgs.values()) == [(0, 2), (1, 2)]


def test_same_node_copy_only_where_ray_node_ids_match_and_both_ranks_serve_new_weights(
    ray_two_nodes, two_node_server, first_update, tiny_model
):
    head, worker = ray_two_nodes
    server = two_node_server
    nodes = first_update["nodes"]
    head_node, worker_node = nodes[first_update["local_ip"]], nodes[worker.node_ip]

    def check(out, trainer_node, lane_rank, expected_paths, seed, version):
        tr = out["trainer"]
        assert tr["node_id"] == trainer_node
        # The rank on the trainer's node is reached over its call lane; the
        # other pulls refs of the client's bucket slots, put with SGLANG_IPC
        # (auto: every rank without a lane accepts it).
        assert (tr["lanes"], tr["ref_transport"]) == ([lane_rank], "SGLANG_IPC")
        new = random_state_dict(tiny_model, seed)
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        stats = tr["stats"]
        assert (stats["tensors"], stats["bytes"], stats["bytes_moved"], stats["ranks"]) == (
            len(new), model_bytes, 2 * model_bytes, 2)
        # The path each rank's pulls took, as the rank itself reports it.
        lasts = [rs["last_update"] for rs in tr["rank_stats"]]
        assert [last["transport"] for last in lasts] == expected_paths
        assert [(last["weight_version"], last["tensors"], last["bytes"]) for last in lasts] == [
            (version, len(new), model_bytes)] * 2
        assert [st["weights_consistent"] for st in tr["status"]] == [True, True]
        assert sorted(stats["transport"].split(",")) == sorted(expected_paths)
        # Greedy output == Hugging Face with the new weights, from each rank.
        expected = hf_greedy(tiny_model, PROMPT, 12, new)
        assert expected != hf_greedy(tiny_model, PROMPT, 12)
        for dp in (0, 1, 0, 1):
            res = server.generate(PROMPT, 12, routed_dp_rank=dp)
            assert (res["output_ids"], res["meta_info"]["weight_version"]) == (expected, version)

    # Trainer on the launching node: rank 0 shares its node, rank 1 does not.
    check(first_update, head_node, 0, [SAME_NODE, OTHER_NODE], 7, "two-1")

    # Trainer on the worker node: the paths swap with the node, not the rank.
    out = run_job(head, server, tiny_model, rank_node_ips=["local", worker.node_ip],
                  trainer_node_ip=worker.node_ip, seed=8, version="two-2")
    check(out, worker_node, 1, [OTHER_NODE, SAME_NODE], 8, "two-2")
