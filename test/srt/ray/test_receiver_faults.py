"""A rank's pulls against real Ray + NIXL (CPU memory): bad inputs and faults.

The rank is ``ToyRank`` (rdt_actors.py): the product's standalone rank, with
the SchedulerActor's weight-sync API (``pull_weights``,
``finalize_weight_update``, ``get_weight_sync_status``) around a toy model,
paused as a trainer leaves it between updates. Each rejected pull must leave
every parameter byte-identical; a transfer that breaks mid-way must fail in
bounded time and leave the rank reporting inconsistent weights until a
complete update ends.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import wait_until
from rdt_actors import ToyTrainer, actor_is_dead, toy_model
from sglang.srt.ray.rdt import WeightsInconsistentError  # the public name (any layout)


@pytest.fixture(scope="module")
def nixl_trainer(ray_client):
    """One trainer putting over NIXL for the module (an actor start imports
    sglang: seconds); each test drops its buckets."""
    trainer = ToyTrainer.remote("nixl")
    yield trainer
    ray_client.kill(trainer)


@pytest.fixture(scope="module")
def ipc_trainer(ray_client):
    """The same, putting with SGLANG_IPC (same-node part + NIXL)."""
    trainer = ToyTrainer.remote("SGLANG_IPC")
    yield trainer
    ray_client.kill(trainer)


@pytest.fixture
def pair(ray_client, toy_rank, nixl_trainer):
    ray = ray_client
    ray.get(toy_rank.reset.remote(0), timeout=60)
    yield ray, toy_rank, nixl_trainer
    ray.get(nixl_trainer.drop.remote(), timeout=60)


def _new_weights(seed=1):
    m = toy_model(seed)
    names = [n for n, _ in m.named_parameters()]
    return names, [p.detach().clone() for _, p in m.named_parameters()]


def _pull_in_place(ray, rank, trainer, names, new):
    """``trainer`` puts ``new``, ``rank`` pulls it: every parameter must
    hold its new bytes in the storage it had. Returns the pull's stats."""
    ptrs = ray.get(rank.pointers.remote())
    (ref,) = ray.get(trainer.put.remote(new))
    stats = ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    state = ray.get(rank.state.remote())
    assert all(torch.equal(state[n], t) for n, t in zip(names, new))
    assert ray.get(rank.pointers.remote()) == ptrs
    return stats


def test_valid_pull_is_zero_copy_and_exact(pair):
    ray, rank, trainer = pair
    names, new = _new_weights()
    assert ray.get(rank.register_weight_for_rdt.remote())["registered"] is True
    stats = _pull_in_place(ray, rank, trainer, names, new)
    assert stats["tensors"] == len(names) and stats["bytes"] == sum(t.nbytes for t in new)


def test_a_parameter_reallocated_at_the_update_end_is_registered_again_before_the_next_pull(pair):
    ray, rank, trainer = pair
    names, new = _new_weights(3)
    assert ray.get(rank.register_weight_for_rdt.remote())["registered"] is True
    (ref,) = ray.get(trainer.put.remote(new))
    ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    before = ray.get(rank.registered_ptrs.remote())
    old_ptr = ray.get(rank.pointers.remote())[names[0]]
    assert old_ptr in before
    # The update's post-load processing gives the parameter new storage.
    ray.get(rank.__ray_call__.remote(
        lambda self, name: setattr(self._rdt_sync.port, "post_load", lambda: self.reallocate(name)),
        names[0]))
    ray.get(rank.finalize_weight_update.remote("v1"), timeout=60)
    new_ptr = ray.get(rank.pointers.remote())[names[0]]
    assert new_ptr != old_ptr
    names, new = _new_weights(4)
    (ref,) = ray.get(trainer.put.remote(new))
    stats = ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    assert stats["plan_reused"] is False  # the moved parameter was planned again
    after = ray.get(rank.registered_ptrs.remote())
    assert new_ptr in after and old_ptr not in after and len(after) == len(before)
    state = ray.get(rank.state.remote())
    assert all(torch.equal(state[n], t) for n, t in zip(names, new))
    assert ray.get(rank.pointers.remote())[names[0]] == new_ptr


def test_pull_before_register_still_works(pair):
    ray, rank, trainer = pair
    names, new = _new_weights(2)
    assert _pull_in_place(ray, rank, trainer, names, new)["registered"] is False


BAD_CASES = {
    "unknown name": (lambda names, new: (names[:-1] + ["2.nope"], new), "unknown parameter '2.nope'"),
    "duplicate name": (lambda names, new: ([names[0]] * 2 + names[2:], new), "duplicate parameter '0.weight'"),
    "shape mismatch": (lambda names, new: (names, [new[0][:, :32].contiguous()] + new[1:]),
                       r"layout mismatch for '0.weight'.*shape=\[64, 32\].*shape=\[64, 64\]"),
    "dtype mismatch": (lambda names, new: (names, [new[0]] + [new[1].double()] + new[2:]),
                       r"layout mismatch for '0.bias'.*dtype=float64.*dtype=float32"),
    "too few names": (lambda names, new: (names[:-1], new), "too few names"),
    "too many names": (lambda names, new: (names + ["extra"], new), "too many names.*'extra'"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_rejected_pull_leaves_every_weight_untouched(pair, case):
    ray, rank, trainer = pair
    names, new = _new_weights(3)
    mutate, match = BAD_CASES[case]
    names, tensors = mutate(names, new)
    before = ray.get(rank.checksums.remote())
    (ref,) = ray.get(trainer.put.remote(tensors))
    with pytest.raises(Exception, match=match) as e:
        ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    assert "WeightSyncError" in str(e.value)
    assert ray.get(rank.checksums.remote()) == before
    assert ray.get(rank.get_weight_sync_status.remote())["weights_consistent"] is True


def test_second_bad_ref_stops_the_first_from_landing(pair):
    ray, rank, trainer = pair
    names, new = _new_weights(4)
    before = ray.get(rank.checksums.remote())
    (good,) = ray.get(trainer.put.remote(new[:2]))
    (bad,) = ray.get(trainer.put.remote([new[2].half(), new[3]]))
    with pytest.raises(Exception, match=r"layout mismatch for '2.weight' \(ref 1 tensor 0\)"):
        ray.get(rank.pull_weights.remote([good, bad], [names[:2], names[2:]]), timeout=60)
    assert ray.get(rank.checksums.remote()) == before


def test_noncontiguous_target_is_rejected(pair):
    ray, rank, trainer = pair
    names, new = _new_weights(5)
    assert ray.get(rank.make_noncontiguous.remote("0.weight")) is False
    before = ray.get(rank.checksums.remote())
    (ref,) = ray.get(trainer.put.remote(new))
    with pytest.raises(Exception, match="'0.weight' is not contiguous"):
        ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    assert ray.get(rank.checksums.remote()) == before


@pytest.mark.parametrize("what", ["empty", "plain value", "non-RDT ref", "number"])
def test_bad_refs_are_rejected(pair, what):
    ray, rank, trainer = pair
    names, new = _new_weights(6)
    before = ray.get(rank.checksums.remote())
    if what == "empty":
        call, match = ([], []), "empty pull"
    elif what == "plain value":
        call, match = ([new], names), "expected a ray.ObjectRef, got list"
    elif what == "non-RDT ref":
        (plain,) = ray.get(trainer.put_plain.remote(new))
        call, match = ([plain], names), "is not an RDT object: put it with"
    else:
        call, match = ([42], names), "expected a ray.ObjectRef, got int"
    with pytest.raises(Exception, match=match):
        ray.get(rank.pull_weights.remote(*call), timeout=60)
    assert ray.get(rank.checksums.remote()) == before


def test_ref_whose_owner_died_fails_fast_without_writing(pair):
    ray, rank, _ = pair
    trainer = ToyTrainer.remote("nixl")  # this test kills it
    names, new = _new_weights(7)
    (ref,) = ray.get(trainer.put.remote(new))
    pid = ray.get(trainer.pid.remote())
    before = ray.get(rank.checksums.remote())
    # The ref's value (the RDT metadata) is a ray.put object in this node's
    # object store. Until the raylet frees it for its dead owner, a get still
    # reads it there and NIXL fails on the dead agent instead
    # (RayDirectTransportError): wait until the owner is dead *and* its object
    # is gone, so the pull meets Ray's own owner-died failure every time.
    core_worker = ray._private.worker.global_worker.core_worker
    assert core_worker.object_exists(ref)
    ray.kill(trainer)
    wait_until(lambda: actor_is_dead(trainer, pid), 60, interval=0.1, what="the trainer to die")
    wait_until(lambda: not core_worker.object_exists(ref), 60, interval=0.1,
               what="the dead owner's object to be freed")
    # Fails on Ray's owner-died error (below), not by waiting out the pull's timeout.
    with pytest.raises(WeightsInconsistentError) as e:
        ray.get(rank.pull_weights.remote([ref], names, 60), timeout=120)
    msg = str(e.value)
    assert re.search(
        r"WeightsInconsistentError: a pull of 4 tensors failed mid-transfer after [0-9.]+ s "
        r"\(OwnerDiedError\); some parameters may hold new bytes and others old ones",
        msg,
    ), msg
    assert f"Cause: OwnerDiedError: Failed to retrieve object {ref.hex()}." in msg, msg
    assert "The object's owner has exited." in msg, msg
    assert ray.get(rank.checksums.remote()) == before


def test_dropped_targets_are_a_loud_failure_not_a_silent_no_op(pair):
    ray, rank, trainer = pair
    names, new = _new_weights(8)
    before = ray.get(rank.checksums.remote())
    (ref,) = ray.get(trainer.put.remote(new))
    with pytest.raises(Exception, match="fetched into a new buffer instead of the live parameter"):
        ray.get(rank.pull_with_targets_dropped.remote([ref], names), timeout=60)
    assert ray.get(rank.checksums.remote()) == before  # the model really was not updated
    assert ray.get(rank.get_weight_sync_status.remote())["weights_consistent"] is False


def test_source_is_not_snapshotted_by_put(pair):
    """Why the source bucket must not change before every rank pulled it."""
    ray, rank, trainer = pair
    names, new = _new_weights(9)
    (ref,) = ray.get(trainer.put.remote(new))
    ray.get(trainer.mutate.remote(7.0))
    ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    state = ray.get(rank.state.remote())
    assert all(bool((state[n] == 7.0).all()) for n in names)


KILL_ATTEMPTS = 5
KILL_PULL_TIMEOUT_S = 60


def _pull_while_killing_the_sender_part_way(ray, rank, transport, n, numel):
    """One attempt: a fresh trainer puts ``n`` x ``numel`` floats; the rank
    pulls them while its watcher SIGKILLs the trainer as soon as some but not
    all target bytes are new. Returns (what the watcher did, the pull's error
    or None)."""
    trainer = ToyTrainer.remote(transport)
    try:
        # A rank whose model is n big zero vectors, so the pull writes n * numel floats.
        ray.get(rank.reset_big.remote(n, numel), timeout=120)
        (ref,) = ray.get(trainer.put_large.remote(n, numel), timeout=120)
        pid = ray.get(trainer.pid.remote(), timeout=60)
        assert ray.get(rank.arm_sender_kill.remote(pid), timeout=60)
        err = None
        try:
            ray.get(rank.pull_weights.remote([ref], [f"w{i}" for i in range(n)], KILL_PULL_TIMEOUT_S),
                    timeout=2 * KILL_PULL_TIMEOUT_S)
        except Exception as e:
            err = e
        watch = ray.get(rank.disarm_sender_kill.remote(), timeout=60)
    finally:
        ray.kill(trainer)
    return watch, err


@pytest.mark.parametrize("transport", ["nixl", "SGLANG_IPC"])
def test_killing_the_trainer_mid_pull_fails_in_bounded_time_and_marks_inconsistent(
    ray_client, toy_rank, transport, request
):
    ray = ray_client
    n, numel = 64, 4 * 2**20  # 64 x 16 MiB = 1 GiB of float32
    rank = toy_rank
    names = [f"w{i}" for i in range(n)]
    tries = []
    try:
        # The kill lands while the pull runs: the rank itself kills the trainer
        # once it sees the transfer part-way. A kill can still land after the
        # last byte (the transfer then succeeds): try again with a new trainer.
        for _ in range(KILL_ATTEMPTS):
            watch, err = _pull_while_killing_the_sender_part_way(ray, rank, transport, n, numel)
            tries.append((watch, repr(err)[:1000]))
            if err is not None:
                # Only the kill may break the pull.
                assert watch["killed"], f"the pull failed with no kill: {tries}"
                break
        else:
            pytest.fail(f"no pull of {KILL_ATTEMPTS} was caught part-way by the kill: {tries}")
        print(f"[{transport}] caught part-way on attempt {len(tries)} of {KILL_ATTEMPTS}: {watch}")
        msg = str(err)
        assert "WeightsInconsistentError: a pull of 64 tensors failed mid-transfer" in msg, msg
        # Bounded: the pull failed on the kill, not by waiting out its timeout.
        cause = msg[msg.index("Cause: "):]
        assert "Timeout" not in cause.splitlines()[0], cause
        status = ray.get(rank.get_weight_sync_status.remote(), timeout=30)
        assert status["weights_consistent"] is False
        assert "failed mid-transfer" in status["inconsistent_reason"]
        # The rank still works: a bad update is refused, ending the broken
        # update says why it is not clean, and the next full update lands
        # and makes the rank consistent again.
        trainer = request.getfixturevalue("nixl_trainer" if transport == "nixl" else "ipc_trainer")
        (ref2,) = ray.get(trainer.put_large.remote(n, 1024), timeout=60)
        with pytest.raises(Exception, match="layout mismatch"):
            ray.get(rank.pull_weights.remote([ref2], names), timeout=60)
        with pytest.raises(Exception, match="the update ended inconsistent: 64 parameters of a "
                                            "transfer that broke in this update were not written"):
            ray.get(rank.finalize_weight_update.remote(), timeout=60)
        (ref3,) = ray.get(trainer.put_large.remote(n, numel), timeout=120)
        stats = ray.get(rank.pull_weights.remote([ref3], names), timeout=120)
        assert stats["bytes"] == n * numel * 4
        out = ray.get(rank.finalize_weight_update.remote(), timeout=60)
        assert out["success"] and out["update"]["consistent"] is True, out
        assert ray.get(rank.get_weight_sync_status.remote(), timeout=30)["weights_consistent"] is True
        # every parameter holds the new bytes (looked at in the rank: 1 GiB)
        # ("w<i>" holds i + 1; ParameterDict lists its names sorted)
        wrong = ray.get(rank.__ray_call__.remote(lambda self: [
            n for n, p in self.model.named_parameters() if not bool((p == int(n[1:]) + 1).all())]),
            timeout=120)
        assert wrong == []
        ray.get(trainer.drop.remote(), timeout=60)
    finally:
        ray.get(rank.disarm_sender_kill.remote(), timeout=60)
        ray.get(rank.reset.remote(0), timeout=60)  # free the 1 GiB


# --------------------------------------------------------------------------- #
# The same-node path (SGLANG_IPC) on CPU: process_vm_readv, NIXL as fall-back
# --------------------------------------------------------------------------- #
@pytest.fixture
def ipc_pair(ray_client, toy_rank, ipc_trainer):
    ray = ray_client
    ray.get(toy_rank.reset.remote(0), timeout=60)
    yield ray, toy_rank, ipc_trainer
    ray.get(toy_rank.set_env.remote("SGLANG_RDT_CMA", None))
    ray.get(ipc_trainer.drop.remote(), timeout=60)


def test_ipc_pull_on_cpu_reads_the_senders_memory_in_place(ipc_pair):
    ray, rank, trainer = ipc_pair
    names, new = _new_weights(11)
    stats = _pull_in_place(ray, rank, trainer, names, new)
    assert stats["transport"] == "cma"
    (read,) = stats["reads"]  # read straight into the targets, no ray.get
    assert (read["path"], read["method"], read["reason"]) == ("cma", "process_vm_readv", None)
    assert stats["bytes"] == read["bytes"] == sum(t.nbytes for t in new)


def test_ipc_pull_reads_the_senders_memory_as_it_is_at_the_pull(ipc_pair):
    """No copy is made at put time: the rank reads the trainer's tensors themselves."""
    ray, rank, trainer = ipc_pair
    names, new = _new_weights(10)
    (ref,) = ray.get(trainer.put.remote(new))
    ray.get(trainer.mutate.remote(7.0))
    stats = ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    assert stats["transport"] == "cma"
    state = ray.get(rank.state.remote())
    assert all(bool((state[n] == 7.0).all()) for n in names)


def test_ipc_rejected_pull_leaves_every_weight_untouched(ipc_pair):
    ray, rank, trainer = ipc_pair
    names, new = _new_weights(12)
    before = ray.get(rank.checksums.remote())
    new[0] = torch.zeros(64, 32)  # wrong shape for '0.weight'
    (ref,) = ray.get(trainer.put.remote(new))
    with pytest.raises(Exception, match=r"layout mismatch for '0.weight'"):
        ray.get(rank.pull_weights.remote([ref], names), timeout=60)
    assert ray.get(rank.checksums.remote()) == before


def test_ipc_falls_back_to_nixl_with_the_reason(ipc_pair):
    ray, rank, trainer = ipc_pair
    ray.get(rank.set_env.remote("SGLANG_RDT_CMA", "0"))
    names, new = _new_weights(13)
    stats = _pull_in_place(ray, rank, trainer, names, new)
    assert stats["transport"] == "nixl (SGLANG_RDT_CMA=0)"
    (read,) = stats["reads"]  # the ref's NIXL part, through Ray
    assert (read["path"], read["reason"]) == ("nixl", "SGLANG_RDT_CMA=0")
