"""Weight sync on one GPU, trainer and rank in two processes: CUDA IPC reads
through the rank's call lane, fresh tensors every update, and a trainer that
dies while a pull of its tensors is in flight.

GPU only: skipped where ``torch.cuda.is_available()`` is false, and not part
of ``make test`` (run it on a CUDA machine with
``python -m pytest test/srt/ray/gpu``). It starts a local Ray of its own
unless the test process is connected to one already.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU test: needs a CUDA device (CUDA IPC between a trainer and a rank on one GPU); "
                "torch.cuda.is_available() is False here", allow_module_level=True)

import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402

from gpu_actors import GpuRank, GpuTrainer, pattern, sha256, weight_names  # noqa: E402

HERE = Path(__file__).resolve().parent
N, NUMEL = 8, 1 << 20  # 8 float32 vectors of 4 MiB: four groups of two on the direct route
NAMES = weight_names(N)


@pytest.fixture(scope="module")
def gpu_ray():
    owned = not ray.is_initialized()
    if owned:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True,
                 logging_level="ERROR")
    yield ray
    if owned:
        ray.shutdown()


def actor_options():
    # Each actor sees GPU 0 without asking Ray for it (two processes on one GPU),
    # and imports gpu_actors (this directory) and the suite's helpers.
    path = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    return {"runtime_env": {"env_vars": {"PYTHONPATH": path,
                                         "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}}


def expected(seed: int, indices=range(N)):
    return {NAMES[i]: sha256(pattern(NUMEL, seed, i)) for i in indices}


def status(rank):
    return ray.get(rank.get_weight_sync_status.remote(), timeout=120)


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


def test_fresh_tensors_every_update_land_byte_for_byte_over_cuda_ipc(gpu_ray):
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        ptrs = ray.get(rank.pointers.remote(), timeout=300)
        route = ray.get(trainer.connect.remote(rank), timeout=300)
        assert route == {"direct": True, "lanes": [0], "ref_transport": None, "why_not_direct": None}
        for seed in (11, 12, 13):
            out = ray.get(trainer.update.remote(N, NUMEL, seed, f"v{seed}"), timeout=300)
            assert "error" not in out, out
            assert (out["path"], out["transport"], out["tensors"]) == ("direct", "cuda_ipc", N), out
            assert out["lane_calls"] == out["steps"] == 4, out  # one rank, four groups
            assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(seed)
        assert ray.get(rank.pointers.remote(), timeout=60) == ptrs  # written in place
        st = status(rank)
        assert (st["weights_consistent"], st["weight_version"], st["update_open"]) == (True, "v13", False)
        assert st["updates"] == 3 and st["failures"] == {}
        # The trainer's fresh tensors came from its staging pool: the rank keeps it mapped.
        assert st["kept_mappings"]["kept_mappings"] >= 1 and st["lane"]["open"] is True
        ray.get(trainer.close.remote(), timeout=120)
        assert status(rank)["kept_mappings"]["kept_mappings"] == 0  # let go on the client's close
    finally:
        ray.kill(trainer)
        ray.kill(rank)


def test_a_trainer_that_dies_mid_update_leaves_no_torn_tensor_and_the_rank_recovers_on_a_complete_update(gpu_ray):
    """The trainer SIGKILLs itself once the first of four groups landed, while
    the second group's pull (over CUDA IPC) is in flight on the rank. Then:

    * nothing is torn silently: the first group holds the dead trainer's
      bytes, the last two the old ones (never sent), the second either, whole
      (it landed from memory the rank keeps mapped, or could not be read) —
      or, if its read broke mid-way, the rank reports its weights
      inconsistent; the version is the old one and the update stays open;
    * a restarted trainer's first update is refused (its first group was
      written in the open update by the dead process): the rank reports its
      weights inconsistent and the client aborts;
    * its next update is complete: consistent, new version, every byte.
    """
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    first = GpuTrainer.options(**actor_options()).remote()
    second = None
    try:
        assert ray.get(first.connect.remote(rank), timeout=300)["direct"] is True
        assert "error" not in ray.get(first.update.remote(N, NUMEL, 1, "v1"), timeout=300)
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(1)
        base = status(rank)
        first_pid = ray.get(first.pid.remote(), timeout=60)

        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.update.remote(N, NUMEL, 2, "v2", die_after_steps=1), timeout=300)

        # The rank answers for the second group's pull (it landed, or failed:
        # the dead process's memory could not be read).
        def pulls_answered():
            st = status(rank)
            answered = (st["pulls"] - base["pulls"]) + sum(st["failures"].values()) - sum(base["failures"].values())
            return st if answered >= 2 else None

        st = wait_for(pulls_answered, 120, "the rank to answer the pull in flight when the trainer died")
        assert st["weight_version"] == "v1" and st["update_open"] is True
        written = st["update_in_progress"]["params_written"]
        assert 2 <= written <= 4
        sums = ray.get(rank.get_parameter_checksums.remote(), timeout=120)
        old, new = expected(1), expected(2)
        assert all(sums[n] == new[n] for n in NAMES[:2])  # the group that landed before the kill
        assert all(sums[n] == old[n] for n in NAMES[4:])  # groups never sent
        if st["weights_consistent"]:  # the second group landed whole, or not at all
            assert all(sums[n] in (old[n], new[n]) for n in NAMES[2:4])
            assert sum(sums[n] == new[n] for n in NAMES) == written
        else:  # its read broke mid-way: the rank says so, naming the transfer
            assert "failed mid-transfer" in st["inconsistent_reason"]

        # A restarted trainer: its first update meets the dead one's open update.
        second = GpuTrainer.options(**actor_options()).remote()
        assert ray.get(second.connect.remote(rank), timeout=300)["direct"] is True
        refused = ray.get(second.update.remote(N, NUMEL, 3, "v3"), timeout=300)
        assert (refused.get("error"), refused.get("cause")) == ("WeightSyncRankError", "WeightUpdateConflictError")
        assert refused["message"].startswith("rank 0 (gpu-rank) failed during pull of step 1: "
                                             "WeightUpdateConflictError: parameter 'layers.0.weight' was "
                                             f"already written in this update by trainer process {first_pid} "
                                             "(same-node lane)")
        st = status(rank)
        assert st["weights_consistent"] is False and st["update_open"] is False
        # (its second group's pull, in flight too, conflicts as well where the dead one's landed)
        assert st["weight_version"] == "v1" and st["failures"].get("conflict") == 1 + (written == 4)
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == sums  # nothing of it landed

        # Its next update is complete: the rank is whole again.
        out = ray.get(second.update.remote(N, NUMEL, 4, "v4"), timeout=300)
        assert "error" not in out, out
        assert (out["path"], out["transport"]) == ("direct", "cuda_ipc")
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(4)
        st = status(rank)
        assert (st["weights_consistent"], st["inconsistent_reason"], st["weight_version"]) == (True, None, "v4")
    finally:
        for actor in (second, first, rank):
            if actor is not None:
                ray.kill(actor)
