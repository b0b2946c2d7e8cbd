"""Where a pull lands and what is checked before any byte moves (rdt/engine/plan.py:
plan_pull, group_names, PlanCache), the receiver's pull around it (receiver.py,
with in-memory sources) and its registration bookkeeping (registration.py).
No Ray cluster and no NIXL agent: pure functions and a toy model in this process."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from conftest import MemorySource, wait_until

from sglang.srt.managers.weight_listeners import (
    add_weight_listener,
    notify_weights_released,
    notify_weights_resumed,
)
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError
from sglang.srt.ray.rdt.engine import plan as plan_mod
from sglang.srt.ray.rdt.engine.plan import (
    PlanCache,
    TensorSpec,
    group_names,
    plan_pull,
    unique_storages,
)
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.registration import RegistrationBook, expandable_segment_tensors
from sglang.srt.ray.rdt.engine.sources import sources_of
from sglang.srt.ray.rdt.transport import nixl_threads


class FakeScheduler(types.SimpleNamespace):
    """A stand-in scheduler, hashed by identity like sglang's (the registry
    of safe-point queues and listeners holds schedulers weakly)."""

    __hash__ = object.__hash__


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
        (["a.weight", "a.weight"], None,
         r"duplicate parameter 'a.weight' \(ref 0 tensor 0 and ref 0 tensor 1\)"),
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
# The plan cache: a layout seen before reuses its plan until parameters move
# --------------------------------------------------------------------------- #
class Walks:
    """``get_params`` of a PlanCache over ``params``, counting the walks."""

    def __init__(self, params):
        self.params, self.count = params, 0

    def __call__(self):
        self.count += 1
        return dict(self.params)


def _ptrs(plan):
    return [[int(p) for p in t.ptrs] for t in plan.targets]


def test_a_layout_seen_before_reuses_its_plan_without_walking_again():
    params = _params()
    walks = Walks(params)
    cache = PlanCache(walks)
    names = [["a.weight", "a.bias"], ["b.weight"]]
    specs = [_specs(params, ns) for ns in names]
    first, walked, reused = cache.plan(specs, names)
    assert (walked, reused, walks.count) == (True, False, 1)
    assert first.count == 3 and first.nbytes == sum(params[n].nbytes for ns in names for n in ns)
    assert _ptrs(first) == [[params[n].data_ptr() for n in ns] for ns in names]
    again, walked, reused = cache.plan([list(s) for s in specs], [list(ns) for ns in names])
    assert again is first and (walked, reused, walks.count) == (False, True, 1)
    # A caller's key (a lane's layout id) names the layout instead of its specs.
    keyed, _, reused = cache.plan(specs, names, key=("lane", 1))
    assert keyed is not first and reused is False
    assert cache.plan(specs, names, key=("lane", 1))[0] is keyed


def test_changed_names_or_specs_are_planned_anew_and_checked():
    params = _params()
    cache = PlanCache(Walks(params))
    specs = [_specs(params, ["a.weight"])]
    plan_a, _, _ = cache.plan(specs, [["a.weight"]])
    renamed, _, reused = cache.plan([_specs(params, ["a.bias"])], [["a.bias"]])
    assert reused is False and renamed is not plan_a
    assert _ptrs(renamed) == [[params["a.bias"].data_ptr()]]
    # Same names, other specs: a new plan, checked like the first.
    with pytest.raises(WeightSyncError, match="layout mismatch for 'a.weight'"):
        cache.plan([[TensorSpec((4, 3), torch.float16)]], [["a.weight"]])
    # A rejected layout is not kept: the right one still finds its own plan.
    assert cache.plan(specs, [["a.weight"]])[0] is plan_a


def test_a_parameter_reallocated_at_an_update_end_is_planned_again():
    params = _params()
    walks = Walks(params)
    cache = PlanCache(walks)
    plan_a, _, _ = cache.plan([_specs(params, ["a.weight"])], [["a.weight"]])
    plan_b, _, _ = cache.plan([_specs(params, ["b.weight"])], [["b.weight"]])
    old = params["a.weight"].data_ptr()
    params["a.weight"].data = params["a.weight"].data.clone()  # post-load may do this
    new = params["a.weight"].data_ptr()
    assert new != old
    # Only an update's end or a load moves parameters: until one is marked,
    # a pull does not look at them again.
    assert cache.plan([_specs(params, ["a.weight"])], [["a.weight"]])[0] is plan_a
    cache.mark_stale()
    assert cache.stale
    replanned, walked, reused = cache.plan([_specs(params, ["a.weight"])], [["a.weight"]])
    assert (walked, reused) == (True, False) and not cache.stale and walks.count == 2
    assert _ptrs(replanned) == [[new]]
    # The plan whose parameter did not move survives the walk.
    assert cache.plan([_specs(params, ["b.weight"])], [["b.weight"]]) == (plan_b, False, True)


def test_a_parameter_reshaped_or_restrided_in_place_is_planned_again():
    """Same object, same address, other shape (or no longer contiguous): the
    plan made for it does not survive the next walk."""
    params = _params()
    cache = PlanCache(Walks(params))
    cache.plan([_specs(params, ["a.weight"])], [["a.weight"]])
    plan_b, _, _ = cache.plan([_specs(params, ["b.weight"])], [["b.weight"]])
    ptr, shape = params["a.weight"].data_ptr(), tuple(params["a.weight"].shape)
    params["a.weight"].data = params["a.weight"].data.reshape(-1)  # same storage, flat
    assert params["a.weight"].data_ptr() == ptr
    cache.mark_stale()
    with pytest.raises(WeightSyncError, match="layout mismatch for 'a.weight'"):
        cache.plan([[TensorSpec(shape, torch.float32)]], [["a.weight"]])
    assert cache.plan([_specs(params, ["b.weight"])], [["b.weight"]]) == (plan_b, False, True)
    params["b.weight"].data = params["b.weight"].data.t()  # same address, not contiguous
    cache.mark_stale()
    with pytest.raises(WeightSyncError, match="'b.weight' is not contiguous"):
        cache.plan([_specs(params, ["b.weight"])], [["b.weight"]])


def test_a_replaced_parameter_object_drops_every_plan():
    params = _params()
    cache = PlanCache(Walks(params))
    plan_b, _, _ = cache.plan([_specs(params, ["b.weight"])], [["b.weight"]])
    params["a.bias"] = torch.nn.Parameter(torch.zeros(4))  # a load made a new object
    cache.mark_stale()
    again, walked, reused = cache.plan([_specs(params, ["b.weight"])], [["b.weight"]])
    assert walked and not reused and again is not plan_b
    assert cache.params["a.bias"] is params["a.bias"]


def test_forget_walks_again_and_plans_every_layout_anew():
    params = _params()
    walks = Walks(params)
    cache = PlanCache(walks)
    first, _, _ = cache.plan([_specs(params, ["a.bias"])], [["a.bias"]])
    cache.forget()
    again, walked, reused = cache.plan([_specs(params, ["a.bias"])], [["a.bias"]])
    assert again is not first and walked and not reused and walks.count == 2


def test_the_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(plan_mod, "MAX_CACHED_PLANS", 3)
    params = _params()
    cache = PlanCache(Walks(params))
    specs, names = [_specs(params, ["a.bias"])], [["a.bias"]]
    plans = [cache.plan(specs, names, key=k)[0] for k in range(3)]
    assert [cache.plan(specs, names, key=k)[0] for k in range(3)] == plans  # all kept
    cache.plan(specs, names, key=3)  # one more than the bound: the cache starts over
    assert len(cache._plans) <= 3
    again, _, reused = cache.plan(specs, names, key=0)
    assert again is not plans[0] and reused is False


# --------------------------------------------------------------------------- #
# The receiver's pull around the plan (in-memory sources)
# --------------------------------------------------------------------------- #
@pytest.fixture
def receiver():
    """A receiver over a Linear(4, 2); the collector is let go afterwards
    (a pull holds it off until its update ends)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    recv = RdtWeightReceiver(lambda: dict(model.named_parameters()))
    recv.model = model
    yield recv
    recv.close()


def test_a_pull_lands_in_the_live_storage_and_a_second_one_reuses_the_plan(receiver):
    model = receiver.model
    ptrs = [model.weight.data_ptr(), model.bias.data_ptr()]
    new = [torch.full((2, 4), 3.0), torch.full((2,), -1.0)]
    stats = receiver.pull([MemorySource(new)], ["weight", "bias"])
    assert stats["tensors"] == 2 and stats["bytes"] == 40 and stats["plan_reused"] is False
    assert stats["transport"] == "memory" and stats["reads"][0]["path"] == "memory"
    assert torch.equal(model.weight, new[0]) and torch.equal(model.bias, new[1])
    assert [model.weight.data_ptr(), model.bias.data_ptr()] == ptrs
    assert receiver.pull([MemorySource(new)], ["weight", "bias"])["plan_reused"] is True
    assert receiver.state.status()["pulls"] == 2


def test_a_reallocated_parameter_is_written_in_its_new_storage_after_the_update_end(receiver):
    model = receiver.model
    receiver.pull([MemorySource([torch.ones(2, 4)])], ["weight"])
    old = model.weight.data_ptr()
    model.weight.data = torch.zeros(2, 4)  # the update's post-load replaced the storage
    receiver.end_of_update()
    assert receiver.needs_refresh()
    stats = receiver.pull([MemorySource([torch.full((2, 4), 5.0)])], ["weight"])
    assert stats["plan_reused"] is False and model.weight.data_ptr() != old
    assert torch.equal(model.weight, torch.full((2, 4), 5.0))


def test_a_source_failing_mid_read_marks_the_weights_inconsistent_and_drops_the_plans(receiver):
    new = [torch.full((2, 4), 3.0), torch.full((2,), -1.0)]
    receiver.pull([MemorySource(new)], ["weight", "bias"])
    with pytest.raises(WeightsInconsistentError,
                       match=r"a pull of 2 tensors failed mid-transfer .*\(ConnectionError\).*"
                             r"Cause: ConnectionError: the sender went away"):
        receiver.pull([MemorySource(new, fail_at=1)], ["weight", "bias"])
    st = receiver.state.status()
    assert st["weights_consistent"] is False and "failed mid-transfer" in st["inconsistent_reason"]
    assert st["failed_pulls"] == 1 and st["failures"] == {"transfer": 1}
    # The plans were dropped: the next pull plans (and walks) again.
    assert receiver.pull([MemorySource(new)], ["weight", "bias"])["plan_reused"] is False


def test_prepare_plans_and_writes_nothing(receiver):
    before = receiver.model.weight.detach().clone()
    src = MemorySource([torch.full((2, 4), 9.0)])
    out = receiver.prepare([src], ["weight"])
    assert out["tensors"] == 1 and out["plan_reused"] is False and len(src.threads) == 1
    assert torch.equal(receiver.model.weight, before)
    assert receiver.state.status()["update_open"] is False  # nothing was admitted
    assert receiver.pull([src], ["weight"])["plan_reused"] is True


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


def test_registering_walks_once_and_the_first_pull_plans_against_that_walk(monkeypatch):
    """register_weight_for_rdt walks the model to register it; the first pull
    after it plans against that walk instead of walking again."""
    monkeypatch.setattr(nixl_threads, "start_nixl_agent", lambda: 0)
    nixl = FakeNixl()
    model = torch.nn.Linear(4, 2)
    walks = Walks(dict(model.named_parameters()))
    recv = RdtWeightReceiver(walks, registrations=RegistrationBook(nixl.register, nixl.deregister))
    try:
        assert recv.register()["registrations"] == 2 and walks.count == 1
        stats = recv.pull([MemorySource([torch.full((2, 4), 7.0)])], ["weight"])
        assert walks.count == 1 and stats["plan_reused"] is False
        assert torch.equal(model.weight, torch.full((2, 4), 7.0))
        assert len(nixl.live) == 2 and len(nixl.log) == 2  # nothing registered again
        # After the update's end the next pull walks again, as before.
        recv.end_of_update()
        recv.pull([MemorySource([torch.full((2,), 1.0)])], ["bias"])
        assert walks.count == 2 and len(nixl.log) == 2
    finally:
        recv.close()


def test_receiver_drops_registrations_on_release_and_restores_on_resume(monkeypatch):
    # register() builds this process's Ray NIXL agent first, which would start a
    # local Ray instance here; FakeNixl is all this test registers with.
    monkeypatch.setattr(nixl_threads, "start_nixl_agent", lambda: 0)
    nixl = FakeNixl()
    model = torch.nn.Linear(4, 4)
    recv = RdtWeightReceiver(
        lambda: dict(model.named_parameters()),
        registrations=RegistrationBook(nixl.register, nixl.deregister),
    )
    assert recv.register()["registrations"] == 2
    scheduler = FakeScheduler()
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
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.test.rdt_standalone import standalone_rank

    model = torch.nn.Linear(4, 2)
    sync = standalone_rank(model, rank="t")
    try:
        walks = []
        named = sync.port.named_parameters
        sync.port.named_parameters = lambda: walks.append(threading.get_ident()) or named()
        sync.receiver.param_names()  # a first walk, as a first pull makes
        scheduler = FakeScheduler()
        add_weight_listener(scheduler, sync)
        updater = object.__new__(SchedulerWeightUpdaterManager)
        updater.scheduler, updater.metrics_collector = scheduler, None
        with updater._observe_weight_load("disk"):
            model.weight = torch.nn.Parameter(torch.zeros(2, 4))  # what post-load may do
        wait_until(lambda: len(walks) >= 2 and not sync.receiver.needs_refresh(), 10, 0.005,
                   "the walk posted after the load")
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


def test_receiver_refuses_bad_call_shapes_before_touching_anything(receiver):
    before = {n: p.detach().clone() for n, p in receiver.model.named_parameters()}
    with pytest.raises(WeightSyncError, match="empty pull"):
        sources_of([])
    with pytest.raises(WeightSyncError, match="empty pull"):
        receiver.pull([], [])
    with pytest.raises(WeightSyncError, match="expected a ray.ObjectRef, got list"):
        sources_of([[torch.zeros(2)]])
    with pytest.raises(WeightSyncError, match="weights_refs must be a list of refs"):
        sources_of(None)
    with pytest.raises(WeightSyncError, match="too many names.*first extra name: 'bias'"):
        receiver.pull([MemorySource([torch.ones(2, 4)])], ["weight", "bias"])
    assert receiver.state.status()["update_open"] is False  # refused before admission
    receiver.close()
    with pytest.raises(WeightSyncError, match="engine is shut down"):
        receiver.pull([MemorySource([torch.ones(2, 4)])], ["weight"])
    assert all(torch.equal(p, before[n]) for n, p in receiver.model.named_parameters())


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
