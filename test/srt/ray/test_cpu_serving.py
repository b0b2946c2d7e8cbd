"""The Ray backend serving on a CPU host, from the real CLI, on a real Ray head."""

from __future__ import annotations

import time

import pytest

from conftest import (
    live_actors,
    live_placement_groups,
    start_ray_head,
    start_server,
    wait_until,
)
from tiny_model import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"


def test_use_ray_on_cpu_serves_hf_identical_greedy_and_cleans_up_on_sigterm(
    launch_server, tiny_model, ray_client, ray_head
):
    server = launch_server(["--use-ray", "--ray-namespace", ray_head.namespace])
    expected = hf_greedy(tiny_model, PROMPT, 16)
    assert server.output_ids(PROMPT, 16) == expected
    log = server.log()
    assert (
        f"[Ray] connected to Ray cluster at" in log
        and f"namespace '{ray_head.namespace}'" in log
    ), log[-3000:]

    actors = live_actors(ray_client)
    assert len(actors) == 1 and actors[0]["Name"].startswith("sglang_scheduler_node")
    assert len(live_placement_groups(ray_client)) == 1

    t0 = time.monotonic()
    rc = server.terminate(timeout=90)
    assert rc == 0, server.log()[-3000:]
    wait_until(lambda: not live_actors(ray_client), 30, what="scheduler actors gone")
    wait_until(lambda: not live_placement_groups(ray_client), 30, what="placement group removed")
    assert time.monotonic() - t0 < 120


def test_scheduler_actor_death_makes_the_server_exit(launch_server, ray_client, ray_head):
    server = launch_server(["--backend", "ray", "--ray-namespace", ray_head.namespace])
    (actor,) = live_actors(ray_client)
    handle = ray_client.get_actor(actor["Name"], namespace=ray_head.namespace)
    ray_client.kill(handle)
    # No endless 503: the server notices and exits by itself.
    rc = server.proc.wait(timeout=60)
    assert rc != 0
    assert "a Ray scheduler actor failed while serving" in server.log()
    wait_until(lambda: not live_placement_groups(ray_client), 30, what="placement group removed")


def test_unplaceable_ray_backend_exits_with_a_readable_error(tiny_model, tmp_path):
    head = start_ray_head(num_cpus=0, namespace="unplaceable")
    try:
        t0 = time.monotonic()
        server = start_server(
            tiny_model, head,
            ["--use-ray", "--ray-namespace", head.namespace, "--ray-startup-timeout", "10"],
            tmp_path, wait=False,
        )
        try:
            rc = server.proc.wait(timeout=150)
        finally:
            server.terminate(timeout=10)
        elapsed = time.monotonic() - t0
        log = server.log()
        assert rc != 0
        assert "Ray could not place the scheduler placement group within 10 s" in log, log[-3000:]
        assert "[{'CPU': 1.0}]" in log and "{CPU: 0, GPU: 0" in log, log[-3000:]
        assert elapsed < 150
    finally:
        head.stop()
