"""Weight sync on one GPU, trainer and rank in two processes: CUDA IPC reads
through the rank's call lane, fresh tensors every update (in the staging pool
and outside it), an update's copy
done before the trainer reuses its memory, and a trainer that dies while a
pull of its tensors is in flight.

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
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import ray  # noqa: E402

from gpu_actors import GpuRank, GpuTrainer, pattern, sha256, weight_names  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # the suite's waiting.py (imports nothing), without its conftest
from waiting import wait_until  # noqa: E402
N, NUMEL = 8, 1 << 20  # 8 float32 vectors of 4 MiB
# Streamed with 8 MiB buckets: groups of one vector (half a bucket), four alive at most.
STREAM_BUCKET = 8 << 20
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


def test_fresh_tensors_every_update_land_byte_for_byte_over_cuda_ipc(gpu_ray):
    """Tensors made in the staging pool: the rank reads them in place (one
    copy) and keeps the pool mapped across updates."""
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        ptrs = ray.get(rank.pointers.remote(), timeout=300)
        route = ray.get(trainer.connect.remote(rank), timeout=300)
        # register() made no slots (these tensors are read in place): the pool holds only the lane's probe
        assert route.pop("pool_bytes") < N * NUMEL * 4
        assert route == {"direct": True, "lanes": [0], "ref_transport": None, "why_not_direct": None}
        for seed in (11, 12, 13):
            out = ray.get(trainer.update.remote(N, NUMEL, seed, f"v{seed}"), timeout=300)
            assert "error" not in out, out
            assert (out["path"], out["transport"], out["tensors"]) == ("direct", "cuda_ipc", N), out
            assert out["lane_calls"] == out["steps"] == 1, out  # one rank, one group (a mapping)
            assert out["gathered_bytes"] == 0 and out["pool_bytes"] >= out["bytes"], out  # read in place
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


@pytest.mark.parametrize("made", ["outside", "cat", "strided"])
def test_tensors_made_outside_the_staging_pool_are_written_into_the_ranks_parameters(gpu_ray, made):
    """Fresh tensors a trainer makes with plain PyTorch (a clone, a fusing
    torch.cat, a non-contiguous view): one rule, the rank never maps them.
    The rank grants its parameters (mapped here once, they stay where they
    are) and this process writes them, one copy: no slot is made, every byte
    lands. With export="buckets" they are gathered into the slots instead."""
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        ptrs = ray.get(rank.pointers.remote(), timeout=300)
        route = ray.get(trainer.connect.remote(rank), timeout=300)
        assert route["direct"] is True and route["pool_bytes"] < N * NUMEL * 4  # no slots
        mapped = []
        for seed in (21, 22, 23):
            out = ray.get(trainer.update.remote(N, NUMEL, seed, f"v{seed}", made=made), timeout=300)
            assert "error" not in out, out
            assert (out["path"], out["transport"], out["lane_calls"]) == ("write", "cuda_ipc write", 2), out
            assert out["gathered_bytes"] == 0 and out["pool_bytes"] < N * NUMEL * 4, out
            assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(seed)
            mapped.append(status(rank)["kept_mappings"]["kept_mappings"])
        assert mapped == [mapped[0]] * 3  # the rank mapped none of these tensors
        assert ray.get(rank.pointers.remote(), timeout=60) == ptrs
        st = status(rank)
        assert (st["weights_consistent"], st["weight_version"], st["failures"]) == (True, "v23", {})
        ray.get(trainer.close.remote(), timeout=120)
        ray.get(trainer.connect.remote(rank, export="buckets"), timeout=300)
        out = ray.get(trainer.update.remote(N, NUMEL, 24, "v24", made=made), timeout=300)
        assert (out["path"], out["transport"]) == ("buckets", "cuda_ipc"), out
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(24)
    finally:
        ray.kill(trainer)
        ray.kill(rank)


def test_a_put_of_a_registered_bucket_is_read_in_place_and_other_tensors_through_nixl(gpu_ray):
    """``ray.put(..., _tensor_transport="SGLANG_IPC")`` + ``pull_weights``: views of a buffer registered with NIXL
    (miles' bucket) are kept memory, read over CUDA IPC and mapped once; tensors made anywhere are not (NIXL's
    put registers them for the ref's life only), read through NIXL, and the rank keeps no mapping of them."""
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        for seed, registered, transport, kept in ((21, False, "nixl", 0), (22, True, "cuda_ipc", 1),
                                                  (23, True, "cuda_ipc", 1), (24, False, "nixl", 1)):
            refs = ray.get(trainer.put.remote(N, NUMEL, seed, registered), timeout=300)
            out = ray.get(rank.pull_weights.remote(refs, NAMES), timeout=300)
            assert (out["transport"].split(" (")[0], out["tensors"]) == (transport, N), (seed, out)
            assert ("register_nixl_memory" in out["transport"]) is not registered, out["transport"]
            ray.get(rank.finalize_weight_update.remote(f"v{seed}"), timeout=120)
            assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(seed)
            assert status(rank)["kept_mappings"]["kept_mappings"] == kept, seed
    finally:
        ray.kill(trainer)
        ray.kill(rank)


def test_a_failed_update_returns_once_the_rank_copied_and_the_trainer_may_reuse_its_memory(gpu_ray):
    """A stream whose fourth tensor is refused (a name the rank lacks) after
    three groups went out: update() raises only once the rank's copies of
    them are done; the trainer overwrites every tensor at once, and the rank
    holds the update's bytes for those groups, never the overwrite's."""
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        assert ray.get(trainer.connect.remote(rank, bucket_bytes=STREAM_BUCKET), timeout=300)["direct"] is True
        assert "error" not in ray.get(trainer.update.remote(N, NUMEL, 1, "v1"), timeout=300)
        out = ray.get(trainer.update.remote(N, NUMEL, 2, "v2", stream=True, bad_name_at=3, overwrite=True),
                      timeout=300)
        assert out["error"] == "WeightSyncError" and "no.such.parameter" in out["message"], out
        sums = ray.get(rank.get_parameter_checksums.remote(), timeout=120)
        new, old = expected(2), expected(1)
        assert all(sums[n] == new[n] for n in NAMES[:3])  # sent before the refusal: whole
        assert all(sums[n] == old[n] for n in NAMES[3:])
        st = status(rank)
        assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (False, False, "v1")
    finally:
        ray.kill(trainer)
        ray.kill(rank)


def test_an_update_that_returned_is_copied_whole_before_the_trainer_reuses_its_memory(gpu_ray):
    """The rank reads the staging pool in place and has copied it before
    update() returns. 1 GiB as 32 x 32 MiB, overwritten by the trainer right
    after each update returns: the rank holds the update's bytes, not the
    overwrite's."""
    n, numel = 32, 1 << 23
    rank = GpuRank.options(**actor_options()).remote(n, numel)
    trainer = GpuTrainer.options(**actor_options()).remote()
    try:
        assert ray.get(trainer.connect.remote(rank), timeout=300)["direct"] is True
        for seed in (21, 22):
            out = ray.get(trainer.update_then_overwrite.remote(n, numel, seed, f"v{seed}"), timeout=300)
            assert out["transport"] == "cuda_ipc" and len(out["steps"]) == 1, out
            sums = ray.get(rank.get_parameter_checksums.remote(), timeout=300)
            want = {name: sha256(pattern(numel, seed, i)) for i, name in enumerate(weight_names(n))}
            assert sums == want
        st = status(rank)
        assert (st["weights_consistent"], st["weight_version"], st["failures"]) == (True, "v22", {})
    finally:
        ray.kill(trainer)
        ray.kill(rank)


@pytest.mark.parametrize("export", ["auto", "buckets"])
def test_a_trainer_that_dies_mid_update_leaves_no_torn_tensor_and_the_rank_recovers_on_a_complete_update(
        gpu_ray, export):
    """The trainer streams its tensors (one group each) and SIGKILLs itself
    once the first group landed, while later groups are in flight: pulled by
    the rank over CUDA IPC from the staging pool (``auto``) or from the
    slots (``buckets``). Then:

    * nothing is torn silently: the first group holds the dead trainer's
      bytes, the last four the old ones (never sent), the three in flight
      either, whole (each landed from memory the rank keeps mapped, or could
      not be read);
    * the rank sees the trainer's lane close with its update open: it aborts
      that update (the engine was only paused: nobody else would end it) and
      reports its weights inconsistent, naming the trainer; the version stays;
    * a restarted trainer's first complete update makes the rank whole.
    """
    rank = GpuRank.options(**actor_options()).remote(N, NUMEL)
    first = GpuTrainer.options(**actor_options()).remote()
    second = None
    try:
        assert ray.get(first.connect.remote(rank, bucket_bytes=STREAM_BUCKET, export=export),
                       timeout=300)["direct"] is (export == "auto")
        assert "error" not in ray.get(first.update.remote(N, NUMEL, 1, "v1"), timeout=300)
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(1)
        base = status(rank)
        first_pid = ray.get(first.pid.remote(), timeout=60)

        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.update.remote(N, NUMEL, 2, "v2", die_after_steps=1, stream=True), timeout=300)

        st = wait_until(lambda: (lambda s: s if s["failed_updates"] > base["failed_updates"] else None)(
            status(rank)), 120, interval=0.1, what="the rank to abort the dead trainer's update")
        assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (False, False, "v1")
        assert st["inconsistent_reason"] == (f"trainer process {first_pid} (same-node lane) closed its "
                                             "lane before the update it wrote in ended")
        sums = ray.get(rank.get_parameter_checksums.remote(), timeout=120)
        old, new = expected(1), expected(2)
        assert all(sums[n] == new[n] for n in NAMES[:1])  # the group that landed before the kill
        assert all(sums[n] == old[n] for n in NAMES[4:])  # groups never sent
        assert all(sums[n] in (old[n], new[n]) for n in NAMES[1:4])  # whole, one or the other

        # The dead trainer's memory is not held: its mappings close within seconds.
        wait_until(lambda: status(rank)["kept_mappings"]["kept_mappings"] == 0, 30, interval=0.1,
                   what="the rank to close the dead trainer's mappings")
        # A restarted trainer's complete update: the rank is whole again.
        second = GpuTrainer.options(**actor_options()).remote()
        assert ray.get(second.connect.remote(rank), timeout=300)["direct"] is True
        out = ray.get(second.update.remote(N, NUMEL, 3, "v3"), timeout=300)
        assert "error" not in out, out
        assert (out["path"], out["transport"]) == ("direct", "cuda_ipc")
        assert ray.get(rank.get_parameter_checksums.remote(), timeout=120) == expected(3)
        st = status(rank)
        assert (st["weights_consistent"], st["inconsistent_reason"], st["weight_version"]) == (True, None, "v3")
    finally:
        for actor in (second, first, rank):
            if actor is not None:
                ray.kill(actor)
