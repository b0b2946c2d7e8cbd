"""Ray launch options, actor resources and forwarded settings (ray/launch.py, ray/actor_options.py, rdt/engine/metrics.py)."""

from __future__ import annotations

import threading
import types

import pytest



# --------------------------------------------------------------------------- #
# Launch options travel in a context variable
# --------------------------------------------------------------------------- #
def test_launch_options_apply_inside_their_context_only():
    from sglang.srt.ray.launch import current_launch_options, ray_launch_options

    assert current_launch_options().placement_group is None
    with ray_launch_options(placement_group="pg1", runtime_env={"env_vars": {"A": "1"}}):
        assert current_launch_options().placement_group == "pg1"
        with ray_launch_options(handles_mode=True):
            assert current_launch_options().handles_mode is True
            assert current_launch_options().placement_group is None
        assert current_launch_options().runtime_env == {"env_vars": {"A": "1"}}
    assert current_launch_options().handles_mode is False


def test_launch_options_do_not_leak_across_threads():
    from sglang.srt.ray.launch import current_launch_options, ray_launch_options

    seen = []
    with ray_launch_options(placement_group="mine"):
        t = threading.Thread(target=lambda: seen.append(current_launch_options().placement_group))
        t.start()
        t.join()
    assert seen == [None]


def test_resolve_placement_group_prefers_explicit_then_context():
    from sglang.srt.ray.launch import ray_launch_options, resolve_placement_group

    assert resolve_placement_group("explicit") == ("explicit", True)
    with ray_launch_options(placement_group="ctx"):
        assert resolve_placement_group(None) == ("ctx", True)


def test_the_http_port_is_held_from_before_launch_and_a_taken_one_fails_naming_it():
    import socket

    from sglang.srt.ray.launch import reserve_http_port

    args = types.SimpleNamespace(host="127.0.0.1", port=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        args.port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"--port {args.port}: the HTTP server cannot bind "
                                               rf"127.0.0.1:{args.port} \(Address already in use\)"):
            reserve_http_port(args)
    held = reserve_http_port(args)  # free now: held until serve_http hands it to uvicorn
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", args.port))  # e.g. a process group picking free ports
    finally:
        held.close()


# --------------------------------------------------------------------------- #
# Device-dependent resources
# --------------------------------------------------------------------------- #
def test_resources_follow_the_device():
    from sglang.srt.ray.cluster import actor_resources, count_rank_bundles, node_bundle

    assert node_bundle("cpu", 2) == {"CPU": 2}
    assert node_bundle("cuda", 4) == {"CPU": 1, "GPU": 4}
    assert actor_resources("cpu") == {"num_cpus": 0, "num_gpus": 0}
    assert actor_resources("cuda") == {"num_cpus": 0, "num_gpus": 1}
    assert count_rank_bundles([{"CPU": 1}, {"CPU": 1}], "cpu") == 2
    assert count_rank_bundles([{"CPU": 1}, {"CPU": 1, "GPU": 1}], "cuda") == 1
    with pytest.raises(ValueError, match="exactly 1 GPU per bundle"):
        count_rank_bundles([{"GPU": 2}], "cuda")


def test_actors_get_the_sglang_env_vars_and_nothing_else(monkeypatch):
    from sglang.srt.ray.actor_options import forwarded_env

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    env = forwarded_env()
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and "UNRELATED_VAR" not in env


def test_metrics_dir_is_forwarded_only_to_actors_on_this_node(monkeypatch, tmp_path):
    from sglang.srt.ray import actor_options

    here = "node-here"
    monkeypatch.setattr(
        actor_options.ray, "get_runtime_context",
        lambda: types.SimpleNamespace(get_node_id=lambda: here),
    )
    table = {"bundles_to_node_id": {0: here, 1: "node-other"}}
    monkeypatch.setattr(actor_options.ray.util, "placement_group_table", lambda pg: table)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert actor_options.metrics_env(object(), 0) == {}  # metrics off: nothing to share
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert actor_options.metrics_env(object(), 0) == {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    assert actor_options.metrics_env(object(), 1) == {}  # another node cannot see the dir
    assert actor_options.metrics_env(object(), 7) == {}  # unknown bundle: do not guess


def test_metrics_backend_follows_where_sglang_sends_its_own(monkeypatch, tmp_path):
    from sglang.srt.ray.rdt.engine import metrics

    monkeypatch.setattr(metrics, "_sglang_uses_ray_collectors", lambda: False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert metrics.default_backend() == "ray"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    assert metrics.default_backend() == "ray"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert metrics.default_backend() == "prometheus"
    monkeypatch.setattr(metrics, "_sglang_uses_ray_collectors", lambda: True)
    assert metrics.default_backend() == "ray"
    with pytest.raises(ValueError, match="unknown metrics backend 'statsd'"):
        metrics.metric_factories("statsd")
