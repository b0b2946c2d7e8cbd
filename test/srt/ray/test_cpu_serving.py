"""The Ray backend serving on a CPU host, from the real CLI, on a real Ray head.

The servers here are started without ``--enable-rdt-weight-sync``. One
``--use-ray`` server serves the tests that only look at it and then the one
that stops it with SIGTERM (a test that finds it stopped starts another);
killing a scheduler actor takes a server of its own, and the unplaceable
engine a Ray head without CPUs.
"""

from __future__ import annotations

import pytest
import requests

from conftest import live_actors, live_placement_groups, start_ray_head, start_server, wait_until
from tiny_model import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
WEIGHT_SYNC_METHODS = ("register_weight_for_rdt", "pull_weights", "get_weight_sync_status",
                       "finalize_weight_update", "shutdown_weight_sync")


def _plain_actors(ray):
    return [a for a in live_actors(ray) if a["Name"].startswith("sglang_scheduler_node")]


def _group_ids(ray):
    return {pg["placement_group_id"] for pg in live_placement_groups(ray)}


@pytest.fixture(scope="module")
def plain_servers(ray_head, ray_client, tiny_model, tmp_path_factory):
    """``get()``: the module's ``--use-ray`` server, started on first use and
    again when a test stopped it. ``groups(server)``: the placement groups
    that appeared when it started."""
    servers, groups = [], {}

    def get():
        if not servers or servers[-1].proc.poll() is not None:
            before = _group_ids(ray_client)
            server = start_server(tiny_model, ray_head, ["--use-ray", "--ray-namespace", ray_head.namespace],
                                  tmp_path_factory.mktemp("plain"))
            servers.append(server)
            groups[server.port] = _group_ids(ray_client) - before
        return servers[-1]

    get.groups = lambda server: groups[server.port]
    yield get
    for s in servers:
        s.terminate()


@pytest.fixture
def plain_server(plain_servers):
    return plain_servers()


def test_use_ray_on_cpu_serves_hf_identical_greedy_from_one_actor_in_one_group(
    plain_server, plain_servers, tiny_model, ray_client, ray_head
):
    assert plain_server.output_ids(PROMPT, 16) == hf_greedy(tiny_model, PROMPT, 16)
    log = plain_server.log()
    assert (
        "[Ray] connected to Ray cluster at" in log and f"namespace '{ray_head.namespace}'" in log
    ), log[-3000:]
    (actor,) = _plain_actors(ray_client)
    assert actor["ActorClassName"] == "SchedulerActor" and actor["IsDetached"] is False
    assert len(plain_servers.groups(plain_server)) == 1


def test_engine_without_weight_sync_flag_has_plain_scheduler_actors(plain_server, ray_client, ray_head):
    """Without --enable-rdt-weight-sync the ranks are sglang's SchedulerActor
    unchanged: no weight-sync method, no tensor transport, no /weight_sync routes."""
    (actor,) = _plain_actors(ray_client)
    handle = ray_client.get_actor(actor["Name"], namespace=ray_head.namespace)
    for method in WEIGHT_SYNC_METHODS:
        with pytest.raises(AttributeError):
            getattr(handle, method)
    assert handle._ray_enable_tensor_transport is False
    assert requests.get(f"{plain_server.url}/weight_sync/status", timeout=30).status_code == 404
    assert "[RDT]" not in plain_server.log()


def test_sigterm_stops_the_server_and_removes_its_actors_and_group(plain_server, plain_servers, ray_client):
    groups = plain_servers.groups(plain_server)
    assert plain_server.terminate(timeout=90) == 0, plain_server.log()[-3000:]
    wait_until(lambda: not _plain_actors(ray_client), 60, what="scheduler actors gone")
    wait_until(lambda: not groups & _group_ids(ray_client), 60, what="placement group removed")


def test_scheduler_actor_death_makes_the_server_exit(launch_server, ray_client, ray_head):
    actors_before, groups_before = {a["ActorID"] for a in _plain_actors(ray_client)}, _group_ids(ray_client)
    server = launch_server(["--backend", "ray", "--ray-namespace", ray_head.namespace])
    groups = _group_ids(ray_client) - groups_before
    assert len(groups) == 1
    (actor,) = [a for a in _plain_actors(ray_client) if a["ActorID"] not in actors_before]
    handle = ray_client.get_actor(actor["Name"], namespace=ray_head.namespace)
    ray_client.kill(handle)
    # No endless 503: the server notices and exits by itself.
    rc = server.proc.wait(timeout=120)
    assert rc != 0
    assert "a Ray scheduler actor failed while serving" in server.log()
    wait_until(lambda: not groups & _group_ids(ray_client), 60, what="placement group removed")


def test_unplaceable_ray_backend_exits_with_a_readable_error(tiny_model, tmp_path):
    head = start_ray_head(num_cpus=0, namespace="unplaceable")
    try:
        server = start_server(
            tiny_model, head,
            ["--use-ray", "--ray-namespace", head.namespace, "--ray-startup-timeout", "2"],
            tmp_path, wait=False,
        )
        try:
            rc = server.proc.wait(timeout=240)
        finally:
            server.terminate(timeout=10)
        log = server.log()
        assert rc != 0
        assert "Ray could not place the scheduler placement group within 2 s" in log, log[-3000:]
        assert "[{'CPU': 1.0}]" in log and "{CPU: 0, GPU: 0" in log, log[-3000:]
    finally:
        head.stop()
