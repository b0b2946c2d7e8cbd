"""Embedding the engine: caller placement group, handles mode, rank placement groups.

(A CLI server's actors in the namespace it was given: test_weight_sync_e2e.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from conftest import CPU_SERVER_ARGS, free_port, live_actors, live_placement_groups, wait_until
from tiny_model import hf_greedy

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def test_launch_engine_handles_mode_in_a_host_actor_on_caller_placement_group(
    ray_client, ray_head, tiny_model
):
    ray = ray_client
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}], name=f"caller-pg-{os.getpid()}")
    ray.get(pg.ready(), timeout=60)
    port = free_port()
    argv = ["--model-path", str(tiny_model), "--port", str(port), *CPU_SERVER_ARGS,
            "--backend", "ray", "--enable-rdt-weight-sync",
            "--engine-info-bootstrap-port", str(free_port())]

    @ray.remote(num_cpus=0, max_concurrency=4)
    class EngineHost:
        """miles' SGLangServerActor shape: launch_engine + serve_http on a thread."""

        def __init__(self, argv, pg):
            import threading

            from sglang.srt.ray.http_server import launch_engine, serve_http
            from sglang.srt.server_args import prepare_server_args

            server_args = prepare_server_args(argv)
            engine = launch_engine(server_args, placement_group=pg)
            _, _, _, scheduler_init_result, _ = engine
            self.actors = list(scheduler_init_result.scheduler_actors)
            threading.Thread(
                target=serve_http, args=(engine, server_args), daemon=True, name="sglang-uvicorn"
            ).start()

        def handles(self):
            return self.actors

    host = EngineHost.options(runtime_env={"env_vars": dict(ray_head.env)}).remote(argv, pg)
    try:
        (handle,) = ray.get(host.handles.remote(), timeout=240)
        wait_until(
            lambda: _healthy(port), 120, what="HTTP server of the host actor"
        )
        r = requests.post(f"http://127.0.0.1:{port}/generate", json={
            "text": "the quick brown fox",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}},
            timeout=60)
        assert r.json()["output_ids"] == hf_greedy(tiny_model, "the quick brown fox", 8)

        # The caller's group is used as given: the actor sits in it, and no
        # second group was created.
        placement = ray.get(handle.get_ray_placement.remote(), timeout=30)
        assert placement["placement_group_id"] == pg.id.hex()
        groups = live_placement_groups(ray)
        assert [g["placement_group_id"] for g in groups] == [pg.id.hex()]
        # Handles mode: owned (not detached), named by the placement group.
        (actor,) = live_actors(ray)
        assert actor["IsDetached"] is False
        assert f"_pg{pg.id.hex()[:8]}_bundle0" in actor["Name"] and "_port" not in actor["Name"]
        assert ray.get(handle.get_weight_sync_status.remote(), timeout=30)["enabled"] is True

        # One update through the handles, driven by sglang's own lifecycle.
        _handles_update(ray, port, handle, tiny_model)

        # The schedulers die with their owner.
        ray.kill(host)
        wait_until(lambda: not live_actors(ray), 60, what="scheduler actors to die with the host")
    finally:
        ray.kill(host)
        remove_placement_group(pg)


def _handles_update(ray, port, handle, tiny_model) -> None:
    from miles_actors import MilesLikeTrainer
    from tiny_model import random_state_dict
    import torch

    url = f"http://127.0.0.1:{port}"
    layout = ray.get(handle.get_parameter_layout.remote(), timeout=60)
    assert requests.get(f"{url}/parallelism_config", params={"rank": 0}, timeout=10).json()["tp_size"] == 1
    new = random_state_dict(tiny_model, 71)
    tensors = {n: new[n].to(getattr(torch, v["dtype"])).contiguous() for n, v in layout.items()}
    trainer = MilesLikeTrainer.remote(sum(t.numel() * t.element_size() for t in tensors.values()))
    ray.get(handle.register_weight_for_rdt.remote(), timeout=60)
    for path, body in (("/pause_generation", {"mode": "retract"}),
                       ("/begin_weight_update", {"selector": "all"})):
        assert requests.post(f"{url}{path}", json=body, timeout=60).status_code == 200
    (ref,) = ray.get(trainer.stage_and_put.remote(tensors), timeout=60)
    ray.get(handle.pull_weights.remote([ref], list(tensors)), timeout=120)
    for path, body in (("/update_weight_version", {"new_version": "handles-1"}),
                       ("/end_weight_update", {}), ("/continue_generation", {})):
        assert requests.post(f"{url}{path}", json=body, timeout=60).status_code == 200, path
    r = requests.post(f"{url}/generate", json={
        "text": "the quick brown fox",
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}},
        timeout=60).json()
    assert r["output_ids"] == hf_greedy(tiny_model, "the quick brown fox", 8, new)
    assert r["meta_info"]["weight_version"] == "handles-1"
    ray.kill(trainer)


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_rank_placement_group_pins_rank_0_here_and_fails_readably_without_enough_nodes(ray_client):
    """--ray-placement-strategy's group, on the one-node session cluster."""
    from sglang.srt.ray.cluster import create_rank_placement_group

    ray = ray_client
    here = ray.get_runtime_context().get_node_id()
    before = len(live_placement_groups(ray))
    pg = create_rank_placement_group("cpu", 3, "STRICT_PACK", timeout_s=60)
    try:
        assert pg.bundle_specs == [{"CPU": 1.0}] * 3
        assert ray.util.placement_group_table(pg)["bundles_to_node_id"] == {0: here, 1: here, 2: here}
    finally:
        ray.util.remove_placement_group(pg)
    # STRICT_SPREAD needs one node per rank: a bounded wait, a message that says
    # so, and no group left behind.
    with pytest.raises(RuntimeError, match=r"2 rank bundles with strategy STRICT_SPREAD \(one Ray node per rank"):
        create_rank_placement_group("cpu", 2, "STRICT_SPREAD", timeout_s=3)
    wait_until(lambda: len(live_placement_groups(ray)) == before, 30, what="placement group removed")
    with pytest.raises(ValueError, match="must be one of"):
        create_rank_placement_group("cpu", 2, "EVERYWHERE", timeout_s=3)


def test_a_cli_server_whose_port_is_taken_exits_at_once_naming_it(ray_client, ray_head, tiny_model, tmp_path):
    import socket

    from conftest import start_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = start_server(tiny_model, ray_head, ["--backend", "ray", "--enable-rdt-weight-sync",
                                                     "--ray-namespace", ray_head.namespace],
                              tmp_path, port=port, wait=False)
        try:
            rc = server.proc.wait(timeout=180)  # (sglang's imports take most of it)
        finally:
            server.terminate(timeout=10)
    assert rc != 0
    assert f"--port {port}: the HTTP server cannot bind 127.0.0.1:{port}" in server.log()
    assert not [a for a in live_actors(ray_client) if f"_port{port}_" in a.get("Name", "")]


def test_a_server_that_cannot_bind_after_launch_shuts_its_engine_down(ray_client, ray_head, tiny_model):
    """A host actor's own launch_engine + serve_http (no reservation: the
    port is the caller's to keep free) with the port taken by another
    process: the server gives up once it cannot listen, its engine is
    released, and the error names the port."""
    import socket

    ray = ray_client
    port = free_port()
    argv = ["--model-path", str(tiny_model), "--port", str(port), *CPU_SERVER_ARGS,
            "--backend", "ray", "--enable-rdt-weight-sync", "--engine-info-bootstrap-port", str(free_port())]

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Host:
        def serve(self, argv):
            from sglang.srt.ray.http_server import launch_engine, serve_http
            from sglang.srt.server_args import prepare_server_args

            server_args = prepare_server_args(argv)
            engine = launch_engine(server_args)
            try:
                serve_http(engine, server_args)
            except RuntimeError as e:
                return len(engine[3].scheduler_actors), str(e)
            return len(engine[3].scheduler_actors), None

    host = Host.options(runtime_env={"env_vars": dict(ray_head.env)}).remote()
    with socket.socket() as taken:  # (this process: another one than the server's)
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        try:
            n, error = ray.get(host.serve.remote(argv), timeout=420)
            assert n == 1 and error is not None and f"--port {port}: the HTTP server could not bind" in error
            wait_until(lambda: not live_actors(ray), 60, what="the engine's actors to be released")
        finally:
            ray.kill(host)
