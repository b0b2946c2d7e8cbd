"""The benchmark's trainer: what trainers send, many ways, through the product's client.

Trainer modes (``--modes``, ``--variants``):

* ``stable`` — the same tensors every update, refilled in place (allocated
  once in the client's staging pool, as the client's docs tell a trainer with
  persistent send buffers to do);
* ``fresh`` — new tensors with the same contents every update, made right
  before the call inside ``client.staging()`` (a gather/convert step);
* made with plain PyTorch outside the pool, as RL frameworks make them:
  ``outside`` (``clone``), ``cat`` (each fused from two halves with
  ``torch.cat``, as q/k/v and gate/up are), ``cast`` (through a wider
  integer type and back: a conversion kernel's output), ``views`` (views of
  one flat buffer, as a flattened parameter store holds them) and ``strided``
  (transposed views of the trainer's own storage: not contiguous);
* ``stream`` — a generator that makes each tensor (``clone``) as it is
  consumed and drops it after, passed to ``update()`` (a gather loop under
  memory pressure); ``stream-pooled`` makes them inside ``client.staging()``.

Every update: the trainer's source tensors hold the round's pattern, the rank
poisons its parameters first and checks every byte after. Per update the
trainer records the whole ``update()`` time, the client's own figures, the
peak of this process's allocated memory during the call beyond what was
allocated right before it, and what is still allocated once the caller
dropped its tensors (beyond what was allocated before it made them).

The peer rows (``peer``): the same new tensors shared with PyTorch's own CUDA
IPC (``torch.multiprocessing``'s reductions: what sglang's
``update_weights_from_tensor`` rides on), per tensor or flattened into
buckets, copied into the rank's parameters in its process.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from typing import Any, Dict, List

import ray
import torch

from patterns import Pattern

GB = 1e9


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class BenchTrainer:
    def __init__(self, specs, device_kind: str):
        if device_kind == "cuda":
            self.device = torch.device("cuda", int(ray.get_gpu_ids()[0]))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        self.names = [n for n, _, _ in specs]
        self.base = [torch.empty(s, dtype=d, device=self.device) for _, s, d in specs]
        self.pattern = Pattern(self.base)
        self.nbytes = sum(t.nbytes for t in self.base)
        self._stable: List[torch.Tensor] = []
        self._made_s = None  # the last stream's seconds making tensors (_stream)

    # -- memory -------------------------------------------------------------- #
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0

    def pid(self) -> int:
        return os.getpid()

    # -- what a trainer hands over --------------------------------------------- #
    def _tensors(self, client, mode: str):
        if mode == "stable":
            if not self._stable:
                with client.staging():
                    self._stable = [t.clone() for t in self.base]
            for s, t in zip(self._stable, self.base):
                s.copy_(t)
            return dict(zip(self.names, self._stable))
        if mode == "fresh":
            with client.staging():
                return {n: t.clone() for n, t in zip(self.names, self.base)}
        if mode in OUTSIDE:
            return dict(zip(self.names, OUTSIDE[mode](self.base)))
        if mode == "stream":
            return self._stream()
        if mode == "stream-pooled":
            return self._stream(client.staging)
        raise ValueError(f"unknown trainer mode {mode!r}")

    def _stream(self, making=None):
        """The stream's generator (each tensor made inside ``making()``, if
        given); ``self._made_s``: the seconds it spent making tensors."""
        import contextlib

        self._made_s = 0.0
        for n, t in zip(self.names, self.base):
            t0 = time.perf_counter()
            with making() if making is not None else contextlib.nullcontext():
                new = t.clone()
            self._made_s += time.perf_counter() - t0
            yield n, new

    # -- the product's client ---------------------------------------------------- #
    def client_run(self, rank, mode: str, opts: Dict[str, Any], rounds: int, seed0: int):
        from sglang.srt.ray.rdt import WeightSyncClient

        client = WeightSyncClient([rank], names=["bench-rank"], sender="local", device=str(self.device),
                                  **opts)
        try:
            t0 = time.perf_counter()
            client.register(None if mode.startswith("stream") else self._tensors(client, mode))
            register_s = time.perf_counter() - t0
            gc.collect()
            out = [self._one_update(client, rank, mode, seed0 + r) for r in range(rounds)]
            route = client.route()
            return {"register_seconds": register_s, "updates": out,
                    "route": {"direct": route.direct, "lanes": len(route.lanes),
                              "why_not_direct": route.why_not_direct},
                    "slot_bytes": 2 * client.sender.slot_bytes}
        finally:
            self._stable = []  # (dropped before close: the pool's memory goes back at close)
            client.close()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.synchronize(self.device)

    def _one_update(self, client, rank, mode: str, seed: int) -> Dict[str, Any]:
        self.pattern.fill(self.base, seed)
        self._sync()
        ray.get(rank.poison.remote(seed))
        baseline = self._allocated()
        self._made_s = None
        named = self._tensors(client, mode)
        self._sync()
        before = self._allocated()
        self._reset_peak()
        wall0 = time.time()
        with CollectorWatch() as collector:
            cpu0, ru0 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
            t0 = time.perf_counter()
            stats = client.update(named, version=f"s{seed}")
            seconds = time.perf_counter() - t0
            cpu1, ru1 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
        peak = self._peak() - before
        del named
        held = self._allocated() - baseline  # (stable tensors: made at register, in the baseline)
        d = stats.as_dict()
        steps = d.pop("buckets")
        pool = client.staging_pool()
        segments = pool.pool.snapshot() if pool is not None else []
        return {"seconds": seconds, "started_at": wall0, "peak_extra_bytes": peak, "held_after_bytes": held,
                # what the staging pool holds and what the rank keeps mapped of this process
                "pool_segments": len(segments), "pool_bytes": sum(int(s["total_size"]) for s in segments),
                "rank_kept_mappings": ray.get(rank.get_weight_sync_status.remote())["kept_mappings"],
                "steps": len(steps), "fill_seconds": sum(s["fill_seconds"] for s in steps),
                "timeline": timeline(t0, t0 + seconds, steps),
                "step_timing": [{"sent": s["sent_at"] - t0, "received": s["received_at"] - t0,
                                 **{k: (v if k.endswith("_seconds") else v - t0)
                                    for k, v in s["rank_timing"].items()}} for s in steps],
                "pull_seconds": sum(s["pull_seconds"] for s in steps),
                "trainer_gc": collector.as_dict(),
                # the calling thread during update(): its CPU time and how often it gave
                # the CPU up waiting or had it taken away (a slow update on a slowed host
                # shows CPU time that grew; on a busy one, the CPU taken away)
                "trainer_thread": {"cpu_seconds": cpu1 - cpu0, "waits": ru1.ru_nvcsw - ru0.ru_nvcsw,
                                   "preempted": ru1.ru_nivcsw - ru0.ru_nivcsw},
                # a stream: what its generator spent making tensors (the trainer's own work)
                "generator_seconds": self._made_s,
                **{k: d[k] for k in ("path", "transport", "lane_calls", "held_bytes", "begin_seconds",
                                     "end_seconds", "plan_seconds", "bytes", "tensors",
                                     "gathered_bytes")},
                "check": ray.get(rank.verify.remote(seed))}

    # -- ceilings in this process ------------------------------------------------- #
    def stream_ceiling(self, reps: int) -> Dict[str, Any]:
        """The stream's generator consumed here by a plain ``copy_`` loop."""
        dst = [torch.empty_like(t) for t in self.base]
        times, made = [], []
        for _ in range(reps + 1):
            self._sync()
            t0 = time.perf_counter()
            for d, (_, t) in zip(dst, self._stream()):
                d.copy_(t)
            self._sync()
            times.append(time.perf_counter() - t0)
            made.append(self._made_s)
        del dst
        return {"seconds": sorted(times[1:])[len(times[1:]) // 2], "all": times[1:],
                "generator_seconds": made[1:]}

    # -- the peer path ------------------------------------------------------------ #
    def peer_run(self, rank, kind: str, bucket_bytes: int, rounds: int, seed0: int):
        """New tensors every update shared through PyTorch's CUDA IPC and
        copied into the rank's parameters: ``per_tensor`` or ``buckets``."""
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for r in range(rounds):
            seed = seed0 + r
            self.pattern.fill(self.base, seed)
            ray.get(rank.poison.remote(seed))
            fresh = [t.clone() for t in self.base]
            self._sync()
            t0 = time.perf_counter()
            if kind == "per_tensor":
                ray.get(rank.peer_copy.remote([reduce_tensor(t) for t in fresh], self.names))
            else:
                for names, tensors in _by_bytes(self.names, fresh, bucket_bytes):
                    offsets, at = [], 0
                    for t in tensors:
                        offsets.append(at)
                        at += t.nbytes
                    bucket = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
                    self._sync()
                    ray.get(rank.peer_copy_bucket.remote(reduce_tensor(bucket), names, offsets))
                    del bucket
            ray.get(rank.finalize_weight_update.remote(f"p{seed}"))
            seconds = time.perf_counter() - t0
            del fresh
            out.append({"seconds": seconds, "check": ray.get(rank.verify.remote(seed))})
        return {"updates": out}

    def lora_run(self, rank, lora_specs, rounds: int, seed0: int):
        """An adapter-only update (``lora_specs``: its tensors) through the
        client, new tensors every update made inside ``client.staging()``."""
        from sglang.srt.ray.rdt import WeightSyncClient

        names = [n for n, _, _ in lora_specs]
        base = [torch.empty(s, dtype=d, device=self.device) for _, s, d in lora_specs]
        pattern = Pattern(base)
        client = WeightSyncClient([rank], names=["bench-rank"], device=str(self.device))
        out = []
        try:
            reg = client.register_lora_adapter("rl", {"peft_type": "LORA", "r": lora_specs[0][1][0],
                                                      "lora_alpha": 16, "target_modules": "all-linear"})
            with client.staging():  # registered as the other modes register theirs: the first update is prepared
                first = dict(zip(names, [t.clone() for t in base]))
            client.register(first)
            del first
            for r in range(rounds):
                seed = seed0 + r
                pattern.fill(base, seed)
                with client.staging():
                    fresh = dict(zip(names, [t.clone() for t in base]))
                self._sync()
                t0 = time.perf_counter()
                stats = client.update(fresh, version=f"l{seed}")
                seconds = time.perf_counter() - t0
                del fresh
                out.append({"seconds": seconds, "path": stats.path, "check": ray.get(rank.verify_lora.remote(seed))})
        finally:
            client.close()
        return {"updates": out, "tensors": len(names), "bytes": sum(t.nbytes for t in base),
                "registered": reg.get("status")}

    def miles_run(self, rank, transport: str, bucket_bytes: int, rounds: int, seed0: int):
        """miles' trainer loop by hand, with new tensors every update: one
        registered bucket buffer; per bucket stage the tensors into it, put
        its views, pull_weights, wait; then finalize."""
        from ray.experimental import register_nixl_memory

        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()
        groups = list(_by_bytes(self.names, self.base, bucket_bytes))
        buf = torch.empty(max(sum(t.nbytes for t in ts) for _, ts in groups), dtype=torch.uint8,
                          device=self.device)
        register_nixl_memory(buf)
        out = []
        for r in range(rounds):
            seed = seed0 + r
            self.pattern.fill(self.base, seed)
            ray.get(rank.poison.remote(seed))
            fresh = dict(zip(self.names, [t.clone() for t in self.base]))
            self._sync()
            parts = dict.fromkeys(("stage", "put", "call", "rank_pull", "rank_plan", "finalize"), 0.0)
            t0 = time.perf_counter()
            for names, _ in groups:
                t1 = time.perf_counter()
                views, at = [], 0
                for n in names:
                    t = fresh[n]
                    v = buf[at:at + t.nbytes].view(t.dtype).view(t.shape)
                    v.copy_(t)
                    views.append(v)
                    at += t.nbytes
                self._sync()
                t2 = time.perf_counter()
                ref = ray.put(views, _tensor_transport=transport)
                t3 = time.perf_counter()
                got = ray.get(rank.pull_weights.remote([ref], names))
                t4 = time.perf_counter()
                del ref
                parts["stage"] += t2 - t1
                parts["put"] += t3 - t2
                parts["call"] += t4 - t3
                parts["rank_pull"] += got.get("seconds", 0.0)
                parts["rank_plan"] += got.get("plan_seconds", 0.0)
            t5 = time.perf_counter()
            ray.get(rank.finalize_weight_update.remote(f"m{seed}"))
            seconds = time.perf_counter() - t0
            parts["finalize"] = seconds - (t5 - t0)
            del fresh
            out.append({"seconds": seconds, "parts": parts, "check": ray.get(rank.verify.remote(seed))})
        return {"updates": out}


def _cat(base):
    """Each tensor fused from its two halves (``torch.cat``): a new allocation per tensor."""
    return [torch.cat(t.chunk(2)) if t.shape[0] > 1 else t.clone() for t in base]


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _cast(base):
    """Each tensor through a wider integer type and back (bit-exact): a conversion's output."""
    return [t.view(_INT[t.element_size()]).to(torch.int64).to(_INT[t.element_size()]).view(t.dtype)
            for t in base]


def _views(base):
    """Views of one flat buffer holding every tensor (a flattened parameter store)."""
    flat = torch.empty(sum(t.nbytes for t in base), dtype=torch.uint8, device=base[0].device)
    out, at = [], 0
    for t in base:
        v = flat[at:at + t.nbytes].view(t.dtype).view(t.shape)
        v.copy_(t)
        out.append(v)
        at += t.nbytes
    return out


def _strided(base):
    """Transposed views of storage laid out the other way (2-D), or every other
    element of a buffer twice the size (1-D): right shape and bytes, not contiguous."""
    out = []
    for t in base:
        if t.dim() >= 2:
            out.append(t.transpose(0, 1).contiguous().transpose(0, 1))
        else:
            store = torch.empty(2 * t.numel(), dtype=t.dtype, device=t.device)
            store[::2].copy_(t)
            out.append(store[::2])
    return out


# Tensors made outside the staging pool, the ways trainers make them.
OUTSIDE = {"outside": lambda base: [t.clone() for t in base],
           "cat": _cat, "cast": _cast, "views": _views, "strided": _strided}


class CollectorWatch:
    """Python's cyclic collections in this process while the block runs:
    how many per generation and the seconds they took (a full collection in
    a process holding Ray and torch takes milliseconds: it shows up as a
    slow update)."""

    def __init__(self):
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._start = None

    def _callback(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1
            self._start = None

    def __enter__(self) -> "CollectorWatch":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def as_dict(self) -> Dict[str, Any]:
        return {"collections": list(self.counts), "seconds": self.seconds}


def timeline(t0: float, t1: float, steps: List[Dict[str, Any]]) -> Dict[str, float]:
    """Where an update's time went (seconds), from the client's step records
    (both processes stamp ``time.perf_counter()``, one clock per host): before
    the first step went out, from sending it to the rank's pull starting, the
    rank's pulls (and the copies in them), the rank idle between its pulls,
    and after the last pull ended (answer, land, the update's end); that last
    part split into the update's end on the rank (a pull that ended it), the
    answer's way back, the client's wait on a fenced pull's copy (a fenced
    pull's "copy" is its queuing: the copy runs on through the end on the
    rank, the answer and this wait) and the rest of the client's end."""
    ranked = [s for s in steps if s["rank_timing"].get("pull_start")]
    if not ranked:
        return {}
    starts = [s["rank_timing"]["pull_start"] for s in ranked]
    ends = [s["rank_timing"]["pull_end"] for s in ranked]
    last = ranked[-1]
    ended = last["rank_timing"].get("ended", ends[-1])
    fence = sum(s["rank_timing"].get("fence_seconds", 0.0) for s in ranked)
    return {"before_send": ranked[0]["sent_at"] - t0, "to_rank": starts[0] - ranked[0]["sent_at"],
            "pulls": sum(e - b for b, e in zip(starts, ends)),
            "copy": sum(s["rank_timing"].get("copy_seconds", 0.0) for s in ranked),
            "gaps": sum(max(0.0, b - e) for e, b in zip(ends, starts[1:])), "after": t1 - ends[-1],
            "end_on_rank": ended - ends[-1], "answer": last["received_at"] - ended,
            "fence_wait": fence, "client_end": t1 - last["received_at"] - fence}


def _by_bytes(names, tensors, bucket_bytes: int):
    """``(names, tensors)`` groups of at most ``bucket_bytes`` (order kept)."""
    cur_n, cur_t, size = [], [], 0
    for n, t in zip(names, tensors):
        if cur_n and size + t.nbytes > bucket_bytes:
            yield cur_n, cur_t
            cur_n, cur_t, size = [], [], 0
        cur_n.append(n)
        cur_t.append(t)
        size += t.nbytes
    if cur_n:
        yield cur_n, cur_t
