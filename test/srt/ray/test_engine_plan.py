"""Validation before any byte moves (rdt/engine/plan.py) and the receiver's registration bookkeeping (rdt/engine/registration.py, receiver.py)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.managers.weight_listeners import (
    add_weight_listener,
    notify_weights_released,
    notify_weights_resumed,
)
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.engine.plan import (
    TensorSpec,
    group_names,
    plan_pull,
    unique_storages,
)
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.registration import RegistrationBook, expandable_segment_tensors


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


def test_sglangs_own_weight_loads_make_the_rank_walk_the_model_again():
    """Every update_weights_from_{disk,distributed,tensor,ipc} of the patched
    weight updater ends in _observe_weight_load, which tells the listeners;
    the rank core then walks the model again (on its loop's thread, not in
    the next pull): the load's post-load processing may have replaced
    parameter objects, which no check of the old objects can see."""
    import threading
    import time

    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.ray.rdt.engine.standalone import standalone_rank

    model = torch.nn.Linear(4, 2)
    sync = standalone_rank(model, rank="t")
    try:
        walks = []
        named = sync.port.named_parameters
        sync.port.named_parameters = lambda: walks.append(threading.get_ident()) or named()
        sync.receiver.param_names()  # a first walk, as a first pull makes
        scheduler = types.SimpleNamespace()
        add_weight_listener(scheduler, sync)
        updater = object.__new__(SchedulerWeightUpdaterManager)
        updater.scheduler, updater.metrics_collector = scheduler, None
        with updater._observe_weight_load("disk"):
            model.weight = torch.nn.Parameter(torch.zeros(2, 4))  # what post-load may do
        deadline = time.monotonic() + 10
        while len(walks) < 2 or sync.receiver.needs_refresh():
            assert time.monotonic() < deadline, walks
            time.sleep(0.005)
        assert walks[1] == sync.loop._thread.ident
        assert sync.receiver._plans.params["weight"] is model.weight
    finally:
        sync.loop.stop()
        sync.shutdown()


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
