"""Fast tests of the pure parts: names, plans, predicates, launch options,
safe points, registration bookkeeping, parallelism config, allocator trap."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from sglang.srt.arg_groups.engine_info_predicates import (
    needs_engine_info_bootstrap_of,
    registers_parallelism_config_of,
)
from sglang.srt.managers.scheduler_safe_point import (
    EventLoopNotRunning,
    SafePointQueue,
    run_safe_point_tasks,
)
from sglang.srt.managers.weight_listeners import (
    add_weight_listener,
    notify_weights_released,
    notify_weights_resumed,
)
from sglang.srt.model_executor.parallelism_config import (
    ParallelismConfigStore,
    global_rank_of,
    install_parallelism_config_routes,
)
from sglang.srt.ray import get_scheduler_actor_name
from sglang.srt.ray.actor_naming import (
    SchedulerActorName,
    is_scheduler_actor_name,
    parse_scheduler_actor_name,
)
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.plan import (
    TensorSpec,
    group_names,
    plan_pull,
    unique_storages,
)
from sglang.srt.ray.rdt.receiver import (
    RdtWeightReceiver,
    RegistrationBook,
    expandable_segment_tensors,
)


# --------------------------------------------------------------------------- #
# Actor names
# --------------------------------------------------------------------------- #
def test_discoverable_name_is_rebuildable_and_has_no_pg():
    name = get_scheduler_actor_name("10.0.0.5", dp_rank=1, pp_rank=0, tp_rank=3, bundle_index=2, port=30000)
    assert name == "sglang_scheduler_node10.0.0.5_port30000_dp1_pp0_tp3_bundle2"
    parsed = parse_scheduler_actor_name(name)
    assert parsed == SchedulerActorName("10.0.0.5", 1, 0, 3, 2, port=30000)
    assert str(parsed) == name


def test_pg_keyed_name_matches_upstream_form():
    pg = "a8557c81ffee00112233"
    name = get_scheduler_actor_name("192.0.2.2", 0, 0, 0, 0, placement_group_id=pg)
    assert name == "sglang_scheduler_node192.0.2.2_dp0_pp0_tp0_pga8557c81_bundle0"
    p = parse_scheduler_actor_name(name)
    assert (p.placement_group_id, p.port) == ("a8557c81", None)


def test_ipv6_and_dp_none_round_trip():
    name = get_scheduler_actor_name("fe80::1", None, 1, 0, 0, port=8000)
    p = parse_scheduler_actor_name(name)
    assert (p.node_ip, p.dp_rank, p.pp_rank) == ("fe80::1", None, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(port=None, placement_group_id=None), "exactly one"),
        (dict(port=1, placement_group_id="ab"), "exactly one"),
        (dict(port=70000), "TCP port"),
        (dict(port=80, tp_rank=-1), "tp_rank"),
    ],
)
def test_name_rejects_ambiguous_or_bad_input(kwargs, match):
    base = dict(node_ip="1.2.3.4", dp_rank=0, pp_rank=0, tp_rank=0, bundle_index=0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        get_scheduler_actor_name(**base)


def test_parse_rejects_foreign_names():
    for bad in ["foo", "sglang_scheduler_node1.2.3.4_dp0_pp0_tp0_bundle0",
                "sglang_scheduler_node1_port1_dp0_pp0_tp0_pgab_bundle0"]:
        assert not is_scheduler_actor_name(bad)
        with pytest.raises(ValueError):
            parse_scheduler_actor_name(bad)


# --------------------------------------------------------------------------- #
# Pull planning (validation before any byte moves)
# --------------------------------------------------------------------------- #
def _params():
    torch.manual_seed(0)
    return {
        "a.weight": torch.nn.Parameter(torch.randn(4, 3)),
        "a.bias": torch.nn.Parameter(torch.randn(4)),
        "b.weight": torch.nn.Parameter(torch.randn(2, 4, dtype=torch.bfloat16)),
    }


def _specs(params, names):
    return [TensorSpec(tuple(params[n].shape), params[n].dtype) for n in names]


def test_plan_returns_the_live_storage_for_each_ref():
    params = _params()
    specs = [_specs(params, ["a.weight", "a.bias"]), _specs(params, ["b.weight"])]
    targets = plan_pull(specs, [["a.weight", "a.bias"], ["b.weight"]], params)
    assert [[t.data_ptr() for t in ts] for ts in targets] == [
        [params["a.weight"].data_ptr(), params["a.bias"].data_ptr()],
        [params["b.weight"].data_ptr()],
    ]


def test_group_names_accepts_flat_and_per_ref_shapes():
    assert group_names(["x", "y", "z"], [2, 1]) == [["x", "y"], ["z"]]
    assert group_names([["x", "y"], ["z"]], [2, 1]) == [["x", "y"], ["z"]]


@pytest.mark.parametrize(
    "names, counts, match",
    [
        (["x", "y"], [3], "too few names: the refs hold 3 tensors"),
        (["x", "y", "z", "w"], [3], "too many names.*first extra name: 'w'"),
        ([["x"], ["y"]], [1], "2 name lists for 1 refs"),
        ([["x", "y"]], [1], "ref 0 holds 1 tensors but 2 names"),
        ("x", [1], "must be a list"),
        ([1], [1], "must be strings"),
    ],
)
def test_group_names_errors(names, counts, match):
    with pytest.raises(WeightSyncError, match=match):
        group_names(names, counts)


@pytest.mark.parametrize(
    "names, spec_override, match",
    [
        (["a.weight", "nope"], None, r"unknown parameter 'nope' \(ref 0 tensor 1\)"),
        (["a.weight", "a.weight"], None, r"duplicate parameter 'a.weight'"),
        (["a.weight"], TensorSpec((3, 4), torch.float32),
         r"layout mismatch for 'a.weight'.*sent shape=\[3, 4\] dtype=float32, the rollout parameter is shape=\[4, 3\] dtype=float32"),
        (["b.weight"], TensorSpec((2, 4), torch.float16),
         r"layout mismatch for 'b.weight'.*dtype=float16.*dtype=bfloat16"),
    ],
)
def test_plan_errors_name_the_parameter(names, spec_override, match):
    params = _params()
    specs = _specs(params, [n if n in params else "a.bias" for n in names])
    if spec_override is not None:
        specs = [spec_override]
    with pytest.raises(WeightSyncError, match=match):
        plan_pull([specs], [names], params)


def test_plan_rejects_noncontiguous_target_and_empty_pull():
    params = _params()
    params["t"] = torch.nn.Parameter(torch.randn(3, 4).t())
    assert not params["t"].is_contiguous()
    with pytest.raises(WeightSyncError, match="'t' is not contiguous"):
        plan_pull([[TensorSpec((4, 3), torch.float32)]], [["t"]], params)
    with pytest.raises(WeightSyncError, match="empty pull"):
        plan_pull([], [], params)


def test_unknown_name_suggests_close_matches():
    params = _params()
    with pytest.raises(WeightSyncError, match="did you mean 'a.weight'"):
        plan_pull([[TensorSpec((4, 3), torch.float32)]], [["a.weigth"]], params)


def test_unique_storages_dedups_views_of_one_storage():
    base = torch.zeros(10)
    a, b, c = base[:5], base[5:], torch.zeros(3)
    assert len(unique_storages([a, b, c, c])) == 2


# --------------------------------------------------------------------------- #
# Registration bookkeeping (memory saver, stale registrations)
# --------------------------------------------------------------------------- #
class FakeNixl:
    def __init__(self):
        self.live = {}
        self.log = []

    def register(self, t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        assert key not in self.live, "double registration"
        self.live[key] = t
        self.log.append(("reg", key))

    def deregister(self, t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        del self.live[key]
        self.log.append(("dereg", key))


def test_registration_book_syncs_to_current_storages():
    nixl = FakeNixl()
    book = RegistrationBook(nixl.register, nixl.deregister)
    w = torch.zeros(8)
    assert book.sync([w, w[:4]]) == {"added": 1, "dropped": 0}
    assert book.sync([w]) == {"added": 0, "dropped": 0}
    # The parameter was re-allocated (e.g. grown by post-load processing):
    # the stale registration is dropped, the new storage registered.
    w2 = torch.zeros(16)
    assert book.sync([w2]) == {"added": 1, "dropped": 1}
    assert list(nixl.live) == [(w2.data_ptr(), w2.untyped_storage().nbytes())]
    assert book.release_all() == 1 and not nixl.live


def test_receiver_drops_registrations_on_release_and_restores_on_resume():
    nixl = FakeNixl()
    model = torch.nn.Linear(4, 4)
    recv = RdtWeightReceiver(
        lambda: dict(model.named_parameters()),
        registrations=RegistrationBook(nixl.register, nixl.deregister),
    )
    assert recv.register()["registrations"] == 2
    scheduler = types.SimpleNamespace()
    add_weight_listener(scheduler, recv)
    notify_weights_released(scheduler)
    assert nixl.live == {} and recv.status()["weights_released"] is True
    with pytest.raises(WeightSyncError, match="weights are released"):
        recv.pull([object()], ["weight"])
    notify_weights_resumed(scheduler)
    assert len(nixl.live) == 2 and recv.status()["registrations"] == 2
    # Deregistered receivers stay deregistered across release/resume.
    recv.deregister()
    notify_weights_released(scheduler)
    notify_weights_resumed(scheduler)
    assert nixl.live == {}


def test_memory_saver_skips_registration_and_says_why():
    model = torch.nn.Linear(2, 2)
    recv = RdtWeightReceiver(
        lambda: dict(model.named_parameters()),
        registration_disabled_reason="--enable-memory-saver: parameter storage is released",
    )
    out = recv.register()
    assert out == {"registered": False, "reason": "--enable-memory-saver: parameter storage is released"}
    assert recv.status()["registered"] is False


def test_receiver_refuses_bad_call_shapes_before_touching_anything():
    model = torch.nn.Linear(2, 2)
    recv = RdtWeightReceiver(lambda: dict(model.named_parameters()))
    with pytest.raises(WeightSyncError, match="empty pull"):
        recv.pull([], [])
    with pytest.raises(WeightSyncError, match="expected a ray.ObjectRef, got list"):
        recv.pull([[torch.zeros(2)]], ["weight"])
    recv.close()
    with pytest.raises(WeightSyncError, match="engine is shut down"):
        recv.pull([object()], ["weight"])


def test_expandable_segment_detection_from_allocator_snapshot():
    t = types.SimpleNamespace(is_cuda=True, data_ptr=lambda: 1_000_100)
    u = types.SimpleNamespace(is_cuda=True, data_ptr=lambda: 5_000_000)
    snapshot = [
        {"address": 1_000_000, "total_size": 1_000, "is_expandable": True},
        {"address": 5_000_000, "total_size": 1_000, "is_expandable": False},
    ]
    assert expandable_segment_tensors([t, u], snapshot) == [t]
    assert expandable_segment_tensors([u], snapshot) == []
    cpu = torch.zeros(1)
    assert expandable_segment_tensors([cpu], snapshot) == []


# --------------------------------------------------------------------------- #
# Safe points: work queued from other threads runs on the loop thread
# --------------------------------------------------------------------------- #
def test_safe_point_runs_tasks_on_the_loop_thread():
    q = SafePointQueue()
    sched = types.SimpleNamespace(safe_point_tasks=q)
    q.loop_started()
    stop = threading.Event()
    loop_thread = {}

    def loop():
        loop_thread["id"] = threading.get_ident()
        while not stop.is_set():
            run_safe_point_tasks(sched)
            time.sleep(0.001)

    th = threading.Thread(target=loop)
    th.start()
    try:
        assert q.call(sched, lambda s: threading.get_ident(), 5) == loop_thread["id"]
        with pytest.raises(KeyError):
            q.call(sched, lambda s: {}["missing"], 5)
    finally:
        stop.set()
        th.join()
    q.loop_stopped()
    with pytest.raises(EventLoopNotRunning, match="engine shut down"):
        q.call(sched, lambda s: 1, 1)


def test_safe_point_times_out_without_running_the_task():
    q = SafePointQueue()
    q.loop_started()  # a loop that never reaches a safe point
    ran = []
    with pytest.raises(TimeoutError, match="nothing was changed"):
        q.call(None, lambda s: ran.append(1), 0.2)
    q.run_pending(None)  # the loop comes back later: the task was cancelled
    assert ran == []


def test_safe_point_runs_inline_before_the_loop_starts():
    q = SafePointQueue()
    assert q.call("sched", lambda s: s + "!", 1) == "sched!"


@pytest.mark.parametrize("attach", [True, False])
def test_sleeping_idle_loop_wakes_for_a_queued_task(attach):
    """--sleep-on-idle: sglang's IdleSleeper blocks in a 1 s poll on the
    scheduler's sockets; a queued weight-sync task must wake it."""
    import zmq

    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
    from sglang.srt.managers.scheduler_safe_point import wake_idle_sleeper_on_tasks

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)  # a tokenizer socket nobody sends on
    sock.bind("inproc://idle-test")
    sched = types.SimpleNamespace(idle_sleeper=IdleSleeper([sock]))
    q = SafePointQueue()
    sched.safe_point_tasks = q
    if attach:
        assert wake_idle_sleeper_on_tasks(sched, q) is True
    assert wake_idle_sleeper_on_tasks(types.SimpleNamespace(), q) is False
    q.loop_started()
    stop = threading.Event()

    def loop():  # the scheduler's idle iterations: take in work, then sleep
        while not stop.is_set():
            run_safe_point_tasks(sched)
            sched.idle_sleeper.maybe_sleep()

    th = threading.Thread(target=loop)
    th.start()
    waits = []
    try:
        for _ in range(3):
            time.sleep(0.1)  # the loop is back in its poll
            t0 = time.monotonic()
            assert q.call(sched, lambda s: "ran", 5) == "ran"
            waits.append(time.monotonic() - t0)
    finally:
        stop.set()
        th.join(timeout=5)  # at most one more poll timeout
        sock.close(0)
        ctx.term()
    if attach:
        assert max(waits) < 0.3, waits
    else:  # without the wake fd every call waits for the poll timeout
        assert min(waits) > 0.5, waits


# --------------------------------------------------------------------------- #
# Predicates and parallelism config
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "te, bootstrap, rdt, needs, registers",
    [
        (False, False, False, False, False),
        (True, False, False, True, False),
        (False, True, False, True, True),
        (False, False, True, True, True),
    ],
)
def test_engine_info_predicates(te, bootstrap, rdt, needs, registers):
    cfg = types.SimpleNamespace(
        remote_instance_weight_loader_start_seed_via_transfer_engine=te,
        enable_engine_info_bootstrap=bootstrap,
        enable_rdt_weight_sync=rdt,
    )
    assert needs_engine_info_bootstrap_of(cfg) is needs
    assert registers_parallelism_config_of(cfg) is registers


def test_server_args_predicates_fold_in_the_flags():
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", "/nonexistent", "--device", "cpu"]
    plain = prepare_server_args(base)
    assert not plain.needs_engine_info_bootstrap() and not plain.registers_parallelism_config()
    boot = prepare_server_args(base + ["--enable-engine-info-bootstrap"])
    assert boot.needs_engine_info_bootstrap() and boot.registers_parallelism_config()
    rdt = prepare_server_args(base + ["--backend", "ray", "--enable-rdt-weight-sync"])
    assert rdt.needs_engine_info_bootstrap() and rdt.registers_parallelism_config()


def test_rdt_flag_without_ray_backend_is_refused():
    from sglang.srt.arg_groups.ray_backend_checks import check_weight_sync_args

    args = types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=False, rdt_pull_timeout=1)
    with pytest.raises(ValueError, match="needs the Ray backend: add --backend ray"):
        check_weight_sync_args(args)
    check_weight_sync_args(types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=True, rdt_pull_timeout=1))


def test_rdt_flag_without_nixl_says_what_to_install(monkeypatch):
    import builtins

    from sglang.srt.arg_groups.ray_backend_checks import check_weight_sync_args

    real_import = builtins.__import__

    def no_nixl(name, *a, **k):
        if name == "nixl" or name.startswith("nixl."):
            raise ImportError("No module named 'nixl'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    args = types.SimpleNamespace(enable_rdt_weight_sync=True, use_ray=True, rdt_pull_timeout=1)
    with pytest.raises(ValueError, match=r"pip install nixl-cu13==1\.5\.1 && pip install --no-deps nixl==1\.5\.1"):
        check_weight_sync_args(args)


def test_global_rank_layout():
    assert global_rank_of(dict(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1, dp_rank=0)) == 3
    assert global_rank_of(dict(tp_size=2, pp_size=1, tp_rank=1, pp_rank=0, dp_rank=2, dp_size=3)) == 5
    # Attention DP folds DP into TP: the rank is the TP/PP position.
    assert global_rank_of(dict(tp_size=4, pp_size=1, tp_rank=3, pp_rank=0, dp_rank=1, attn_dp_size=2)) == 3


def test_parallelism_config_routes():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    store = ParallelismConfigStore()
    install_parallelism_config_routes(app, store)
    client = TestClient(app)
    cfg = dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, device="cuda", device_id=1)
    assert client.put("/register_parallelism_config", json=cfg).status_code == 200
    got = client.get("/parallelism_config", params={"rank": 1}).json()
    assert got == {**cfg, "rank": 1}
    assert client.get("/parallelism_config").json() == {"ranks": {"1": {**cfg, "rank": 1}}}
    r = client.get("/parallelism_config", params={"rank": 0})
    assert r.status_code == 404 and "registered ranks: [1]" in r.text
    bad = client.put("/register_parallelism_config", json={"x": 1})
    assert bad.status_code == 400 and "bad parallelism config" in bad.text


# --------------------------------------------------------------------------- #
# Launch options travel in a context variable
# --------------------------------------------------------------------------- #
def test_launch_options_contextvar_scoping():
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


def test_actor_options_forward_sglang_env(monkeypatch):
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
    from sglang.srt.ray.rdt import metrics

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


def test_failure_kinds_of_pull_errors():
    from sglang.srt.ray.rdt.actor_mixin import failure_kind
    from sglang.srt.ray.rdt.errors import WeightsInconsistentError

    from sglang.srt.ray.rdt.errors import WeightUpdateConflictError

    # Broken transfers and conflicts are counted by the update state itself.
    assert failure_kind(WeightsInconsistentError("torn")) is None
    assert failure_kind(WeightUpdateConflictError("two writers")) is None
    assert failure_kind(WeightSyncError("bad name")) == "rejected"
    assert failure_kind(TimeoutError("slow")) == "other"


def test_client_names_are_exported_lazily_from_the_package():
    import sglang.srt.ray.rdt as rdt
    from sglang.srt.ray.rdt.client import WeightSyncClient, WeightSyncRankError

    assert rdt.WeightSyncClient is WeightSyncClient
    assert issubclass(rdt.WeightSyncRankError, WeightSyncError) and rdt.WeightSyncRankError is WeightSyncRankError
    with pytest.raises(AttributeError):
        rdt.NoSuchThing


# --------------------------------------------------------------------------- #
# Cross-memory attach (the CPU half of the same-node path)
# --------------------------------------------------------------------------- #
def test_cma_split_keeps_order_and_bytes():
    from sglang.srt.ray.rdt.cma import split_copies

    copies = [(1000, 5000, 3 << 20), (9000, 70000, 1 << 20)]
    parts = split_copies(copies, 2)
    assert len(parts) == 2
    assert [sum(c[2] for c in p) for p in parts] == [2 << 20, 2 << 20]
    flat = [c for p in parts for c in p]
    # contiguous pieces, in order, covering every byte once
    assert flat[0] == (1000, 5000, 2 << 20) and flat[1] == (1000 + (2 << 20), 5000 + (2 << 20), 1 << 20)
    assert flat[2] == (9000, 70000, 1 << 20)
    assert split_copies([(0, 0, 100)], 4) == [[(0, 0, 100)]]  # small: one part


# A fresh interpreter, not a fork: forking a process that holds a Ray driver
# (the test session's) copies its gRPC state, and torch ops in a forked child
# may wait on OpenMP threads that did not survive the fork.
_CHILD = """
import array, os, sys
buf = array.array("f", range(3 * 2**18))  # 3 MiB of float32 0, 1, 2, ...
addr, n = buf.buffer_info()
print(os.getpid(), addr, n * buf.itemsize, flush=True)
sys.stdin.readline()
"""


def test_cma_reads_another_process_and_reports_faults():
    import errno
    import subprocess
    import sys

    from sglang.srt.ray.rdt.cma import CmaError, CmaReader, process_start_time

    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid, addr, nbytes = map(int, child.stdout.readline().split())
        start = process_start_time(pid)
        assert start is not None and start == process_start_time(pid)
        reader = CmaReader(threads=2)
        assert reader.probe(pid, addr) is None
        dst = torch.zeros(nbytes // 4)
        half = nbytes // 2
        assert reader.read(pid, [(dst.data_ptr(), addr, half), (dst.data_ptr() + half, addr + half, nbytes - half)]) == nbytes
        assert torch.equal(dst, torch.arange(3 * 2**18, dtype=torch.float32))
        with pytest.raises(CmaError) as e:  # an address the sender never mapped
            reader.read(pid, [(dst.data_ptr(), 8, 16)])
        assert e.value.errno == errno.EFAULT and "not mapped in the sender" in str(e.value)
        reader.close()
    finally:
        child.communicate("\n", timeout=30)
    assert process_start_time(pid) is None or process_start_time(pid) != start
    why = CmaReader(threads=1).probe(pid, addr)
    assert why is not None and "ESRCH" in why


def test_cma_resumes_after_partial_reads(monkeypatch):
    import ctypes

    from sglang.srt.ray.rdt import cma

    src = (ctypes.c_ubyte * 64)(*range(64))
    dst = (ctypes.c_ubyte * 64)()
    calls = []

    def stingy_readv(pid, local, nl, remote, nr, flags):
        # copy at most 10 bytes per call, across iovec boundaries, like a
        # kernel that stops at a page it cannot pin
        budget, done = 10, 0
        for i in range(nl):
            n = min(local[i].iov_len, budget - done)
            if n <= 0:
                break
            ctypes.memmove(local[i].iov_base, remote[i].iov_base, n)
            done += n
            if n < local[i].iov_len:
                break
        calls.append(done)
        return done

    monkeypatch.setattr(cma, "_readv", lambda: stingy_readv)
    base_d, base_s = ctypes.addressof(dst), ctypes.addressof(src)
    copies = [(base_d, base_s, 25), (base_d + 25, base_s + 25, 14), (base_d + 39, base_s + 39, 25)]
    assert cma._read_all(1, copies) == 64
    assert bytes(dst) == bytes(range(64)) and len(calls) == 7


def test_ipc_mappings_of_persistent_buffers_survive_the_end_of_an_update(monkeypatch):
    from sglang.srt.ray.rdt import cuda_ipc_transport as cit

    closed = []

    class FakeDriver:
        def push(self, ordinal):
            pass

        def pop(self):
            pass

        def ipc_close(self, ptr):
            closed.append(ptr)

    monkeypatch.setattr(cit, "driver", lambda: FakeDriver())
    t = cit.SglangIpcTransport()
    t._mappings = {
        ("trainer-a", 0x1000): cit._Mapping(b"a", 1 << 30, 0xA000, 1, 0, persistent=True),
        ("trainer-a", 0x2000): cit._Mapping(b"b", 1 << 20, 0xB000, 1, 0, persistent=False),
        ("trainer-b", 0x1000): cit._Mapping(b"c", 1 << 30, 0xC000, 1, 0, persistent=True),
    }
    t._senders = ["trainer-a", "trainer-b"]
    t._plans["some"] = object()
    gen = t._generation
    # end of an update: the trainer may free what it put, but not its
    # persistent bucket slots (it releases those through the ranks first)
    assert t.close_all(keep_persistent=True) == 1
    assert closed == [0xB000] and set(t._mappings) == {("trainer-a", 0x1000), ("trainer-b", 0x1000)}
    assert t._generation > gen and not t._plans  # no copy plan may point into a closed mapping
    # the client of trainer-a closes: only its mappings go
    assert t.release_sender("trainer-a") == 1
    assert closed == [0xB000, 0xA000] and set(t._mappings) == {("trainer-b", 0x1000)}
    assert t._senders == ["trainer-b"]
    # engine shutdown: everything
    assert t.close_all() == 1 and closed[-1] == 0xC000 and not t._mappings and not t._senders


def test_ipc_part_is_persistent_only_when_every_segment_was_declared():
    from sglang.srt.ray.rdt import cuda_ipc_transport as cit

    part = cit.IpcPart(node_id="n", sender="s", pid=1, device_uuid="GPU-x", segments=[], tensors=[])
    assert part.persistent is False  # refs of ordinary tensors: mappings closed after every update
    assert cit.mark_persistent(torch.zeros(4)) is False  # CPU tensors have no CUDA segment


def test_client_bucket_size_defaults_follow_the_bucket_device():
    from sglang.srt.ray.rdt.client import default_bucket_bytes

    assert default_bucket_bytes("cuda") == default_bucket_bytes("cuda:1") == 1 << 30
    assert default_bucket_bytes("cpu") == 256 << 20


# --------------------------------------------------------------------------- #
# NIXL progress thread: no core spinning for the life of every RDT process
# --------------------------------------------------------------------------- #
_IDLE_AGENT = """
import json, os, resource, sys, time
configure = sys.argv[1] == "configure"
if configure:
    from sglang.srt.ray.rdt.nixl_progress import agent_created, configure_nixl_progress_thread
    delay = configure_nixl_progress_thread()
from ray.experimental.rdt.util import get_tensor_transport_manager
agent = get_tensor_transport_manager("NIXL").get_nixl_agent()  # as Ray's first NIXL use does
time.sleep(1.0)
r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(3.0)
r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
out = {"cores": cpu / (w1 - w0)}
if configure:
    from sglang.srt.ray.rdt.nixl_progress import describe
    out.update(delay=delay, created=agent_created(), again=configure_nixl_progress_thread(),
               describe=describe())
print("RESULT " + json.dumps(out), flush=True)
"""


def _idle_agent(ray_head, mode, **env):
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _IDLE_AGENT, mode], capture_output=True, text=True, timeout=180,
        env={**os.environ, **ray_head.env, **env},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stderr


def test_nixl_progress_thread_sleeps_between_events(ray_head):
    # The agent as Ray makes it: its UCX progress thread polls with a 0 delay
    # and keeps a core busy while the process does nothing.
    raw, _ = _idle_agent(ray_head, "plain")
    assert raw["cores"] > 0.4, raw
    # Configured first (what the receiver, the sender and the transport do).
    tamed, err = _idle_agent(ray_head, "configure")
    assert tamed["delay"] == 1000 and tamed["created"] is True, tamed
    assert tamed["cores"] < 0.2, (tamed, raw)
    # Asked again once the agent exists: it says the agent keeps its thread.
    assert tamed["again"] == 1000 and "exists already" in err
    assert tamed["describe"] == "sleeps up to 1000 us between UCX events"
    # 0 keeps NIXL's own setting (documented escape hatch).
    kept, _ = _idle_agent(ray_head, "configure", SGLANG_RDT_NIXL_PROGRESS_DELAY_US="0")
    assert kept["delay"] is None and kept["cores"] > 0.4, kept
    assert kept["describe"] == "busy-polls (NIXL default)"


def test_nixl_progress_delay_setting_is_checked(monkeypatch):
    from sglang.srt.ray.rdt import nixl_progress

    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "soon")
    with pytest.raises(ValueError, match="integer number of microseconds, got 'soon'"):
        nixl_progress.progress_delay_us()
    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "-5")
    with pytest.raises(ValueError, match=">= 0, got -5"):
        nixl_progress.progress_delay_us()
    monkeypatch.setenv("SGLANG_RDT_NIXL_PROGRESS_DELAY_US", "2500")
    assert nixl_progress.progress_delay_us() == 2500
