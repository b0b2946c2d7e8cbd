#!/usr/bin/env python3
"""Speed of RDT weight sync's receiving path, against NCCL and the copy ceiling.

One run measures, for each workload (``uniform``: N equal bf16 tensors;
``model``: the parameters of a decoder built from a transformers config, in
sglang's fused layout), with the sender on one device and the receiver on
another, each in its own Ray actor:

* ``pull``: :class:`sglang.srt.ray.rdt.engine.receiver.RdtWeightReceiver` — the code
  ``SchedulerActor.pull_weights`` runs — pulling one NIXL ref into registered
  live tensors: the cold first pull right after ``register()`` and the median
  of steady pulls, with a stage breakdown (plan, remote-agent load, descriptor
  and transfer set-up, copy) and the receiver's peak extra memory;
* ``nccl`` (CUDA): sglang's ``update_weights_from_distributed`` pattern — per
  bucket of ``--nccl-bucket-mib``, the receiver allocates the bucket's tensors,
  each tensor is broadcast with ``async_op=True``, then copied into the
  parameters (``load_weights``);
* ``ipc``: the same receiver pulling a ref put with the ``SGLANG_IPC``
  transport (:mod:`sglang.srt.ray.rdt.transport.sglang_ipc`): CUDA IPC + copy
  engine on one node (cold, steady, variants of ``--ipc-variants``, and with
  the handle cache off); on CPU the same transport reads the sender's memory
  with ``process_vm_readv`` (:mod:`sglang.srt.ray.rdt.transport.cma`), with the default
  reader threads, then 1 and 2;
* the ceiling: copies of same-shaped tensors between the two devices in the
  driver process (CUDA: one tensor, a per-tensor loop with torch, raw copy
  engine loops on 1 or more streams, one ``cuMemcpyBatchAsync``, one SM copy
  kernel; CPU: memcpy).

Every pull and broadcast is checked byte for byte: the sender fills its tensors
with a deterministic pattern, the receiver poisons its targets first and
compares every byte with the pattern it computes itself.

Examples::

    # GPU (two GPUs): everything, ~60 s on two H200s (docs/performance.md)
    python benchmark/rdt_weight_sync/bench_pull.py --device cuda --steady 7
    # one GPU, trainer and engine colocated (docs/performance.md, "Same GPU"):
    # the client zero-copy and with buckets, miles' loop, per-call cost
    python benchmark/rdt_weight_sync/bench_pull.py --device cuda --same-gpu --steady 7 \
        --client-rounds 20 --client-transports SGLANG_IPC,SGLANG_IPC:buckets \
        --miles-rounds 8 --call-cost 200 --ipc-variants dst:4:ce,dst:1:batch,dst:2:ce,dst:1:ce
    # CPU (CI smoke test): NIXL over DRAM and process_vm_readv vs memcpy, small
    python benchmark/rdt_weight_sync/bench_pull.py --device cpu --uniform 8x1

It starts a local Ray (``ray.init()``) unless ``RAY_ADDRESS`` names a cluster,
and needs only torch, ray (+ nixl) and, for the model workload, transformers:
the sglang modules it drives are imported from this checkout without sglang's
package ``__init__`` (see :func:`light_sglang`). Numbers go to ``--json-out``
(default ``$OUT/bench_pull.json`` when ``OUT`` is set); the table is printed
last, followed by ``BYTE_CHECK: PASS`` or ``FAIL`` (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

GB = 1e9
GiB = 2**30
MiB = 2**20

# A Qwen3-4B-sized decoder (4.02 B parameters, tied embeddings).
PRESETS: Dict[str, Dict[str, Any]] = {
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "tiny": dict(
        model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True, max_position_embeddings=256,
    ),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SRC_ENV = "BENCH_SGLANG_SRC"


def light_sglang() -> None:
    """Make ``sglang.srt.ray.rdt.*`` importable without sglang's package inits.

    An installed sglang runs its top-level ``__init__`` (and ``sglang.srt.ray``'s,
    which imports the engine) on any submodule import: 15+ s on a 2-core box.
    The rdt modules need only torch and ray, so the benchmark stubs those three
    parent packages as namespaces over this checkout's ``python/sglang`` (first)
    and any installed copy. Nothing to do when sglang is already imported.
    """
    import types

    if "sglang" in sys.modules:
        return
    roots = []
    src = os.environ.get(SRC_ENV)
    for p in ([src] if src else []) + sys.path:
        d = os.path.join(p or ".", "sglang")
        if os.path.isdir(d) and os.path.abspath(d) not in roots:
            roots.append(os.path.abspath(d))
    parent = None
    for name, sub in (("sglang", ""), ("sglang.srt", "srt"), ("sglang.srt.ray", "srt/ray")):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(r, sub) for r in roots if os.path.isdir(os.path.join(r, sub))]
        sys.modules[name] = m
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], m)
        parent = m
    if not any(os.path.exists(os.path.join(r, "srt", "environ.py")) for r in roots):
        sys.modules["sglang.srt.environ"] = fork_envs_module(roots)


ENV_PATCH = "*-environ-ray-and-rdt-variables.patch"  # in patches/, numbered by the series


def fork_envs_module(roots):
    """``sglang.srt.environ`` where no sglang is installed (the GPU machine):
    only the fork's Ray/RDT variables, declared as patch 0013 declares them
    (name, type, default), read from the environment like sglang's ``envs``."""
    import re
    import types

    import glob

    patch = None
    for r in roots:
        found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(r)), "patches", ENV_PATCH)))
        if found:
            patch = found[-1]
    if patch is None:
        raise RuntimeError(f"no sglang.srt.environ and no patches/{ENV_PATCH} next to {roots}")

    class Env:
        def __init__(self, name, kind, default):
            self.name, self.kind, self.default = name, kind, default

        def get(self):
            raw = os.environ.get(self.name)
            if raw is None:
                return self.default
            if self.kind == "EnvBool":
                return raw.strip().lower() in ("1", "true", "yes", "on")
            if self.kind == "EnvInt":
                return int(raw)
            if self.kind == "EnvFloat":
                return float(raw)
            return raw

    class Envs:
        pass

    envs = Envs()
    for line in open(patch):
        m = re.match(r"^\+\s+(SGLANG_\w+) = (Env\w+)\((.*)\)\s*$", line)
        if m:
            name, kind, default = m.group(1), m.group(2), eval(m.group(3))  # literals only
            setattr(envs, name, Env(name, kind, default))
    mod = types.ModuleType("sglang.srt.environ")
    mod.envs = envs
    return mod


# --------------------------------------------------------------------------- #
# Workloads: lists of (name, shape, dtype)
# --------------------------------------------------------------------------- #
def uniform_workload(n: int, mib: float, dtype: torch.dtype):
    numel = int(mib * MiB) // torch.empty((), dtype=dtype).element_size()
    return [(f"w.{i}", (numel,), dtype) for i in range(n)]


def model_workload(preset: str, dtype: torch.dtype, layout: str = "sglang"):
    """Parameter names and shapes of a transformers model, without weights.

    ``layout="sglang"`` fuses q/k/v into ``qkv_proj`` and gate/up into
    ``gate_up_proj`` as sglang's model classes do (what a rollout rank holds).
    """
    import transformers

    if os.path.exists(preset):
        cfg = transformers.AutoConfig.from_pretrained(preset)
    else:
        kw = dict(PRESETS[preset])
        mt = kw.pop("model_type")
        try:
            cfg = transformers.AutoConfig.for_model(mt, **kw)
        except (KeyError, ValueError):  # an older transformers without qwen3
            kw.pop("head_dim", None)
            cfg = transformers.AutoConfig.for_model("qwen2", **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied: once
    arch = type(model).__name__
    del model
    if layout == "sglang":
        shapes = fuse_like_sglang(shapes)
    params = sum(int(torch.Size(s).numel()) for _, s in shapes)
    return [(n, s, dtype) for n, s in shapes], {
        "arch": arch, "params": params, "transformers": transformers.__version__,
        "config": {k: getattr(cfg, k, None) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")},
    }


def fuse_like_sglang(shapes):
    out, pending = [], {}
    groups = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3), "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3), "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2),
        "mlp.up_proj": ("mlp.gate_up_proj", 1, 2),
    }
    for name, shape in shapes:
        for part, (fused, pos, count) in groups.items():
            if f".{part}." in name:
                fname = name.replace(part, fused)
                slot = pending.setdefault(fname, [None] * count)
                slot[pos] = shape
                if all(s is not None for s in slot):
                    rows = sum(s[0] for s in slot)
                    out.append((fname, (rows,) + tuple(slot[0][1:])))
                    del pending[fname]
                break
        else:
            out.append((name, shape))
    assert not pending, pending
    return out


# --------------------------------------------------------------------------- #
# Deterministic contents, checked byte for byte
# --------------------------------------------------------------------------- #
def words_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 (or uint8) view."""
    b = t.reshape(-1).view(torch.uint8)
    return b.view(torch.int32) if b.numel() % 4 == 0 else b


def base_pattern(t: torch.Tensor, idx: int, chunk: int = 1 << 24) -> torch.Tensor:
    w = words_of(t)
    out = torch.empty_like(w)
    for start in range(0, w.numel(), chunk):
        n = min(chunk, w.numel() - start)
        x = torch.arange(start, start + n, dtype=torch.int64, device=t.device)
        x = x * 0x9E3779B1 + (idx * 0x632BE5AB + 0x1234567)
        x = x ^ (x >> 17)
        x = (x & 0x7FFFFFFF) * 0x7FEB352D
        x = x ^ (x >> 15)
        if out.dtype == torch.int32:
            x = (x & 0xFFFFFFFF) - 0x80000000
        else:
            x = x & 0xFF
        out[start:start + n] = x.to(out.dtype)
    return out


def seed_const(seed: int, dtype: torch.dtype) -> int:
    c = (seed * 0x01000193 + 0x5BD1E995) & 0x7FFFFFFF
    return c if dtype == torch.int32 else c & 0x7F


class Pattern:
    """Per-tensor base words; round ``seed`` holds ``base ^ const(seed)``."""

    def __init__(self, tensors: List[torch.Tensor]):
        self.base = [base_pattern(t, i) for i, t in enumerate(tensors)]

    def fill(self, tensors, seed: int) -> None:
        for t, b in zip(tensors, self.base):
            torch.bitwise_xor(b, seed_const(seed, b.dtype), out=words_of(t))

    def check(self, tensors, seed: int) -> List[int]:
        bad = []
        for i, (t, b) in enumerate(zip(tensors, self.base)):
            if not torch.equal(words_of(t) ^ seed_const(seed, b.dtype), b):
                bad.append(i)
        return bad


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- #
# Timing of the receiving side's NIXL stages (instrumentation, benchmark only)
# --------------------------------------------------------------------------- #
class StageTimer:
    def __init__(self):
        self.t: Dict[str, float] = defaultdict(float)
        self.n: Dict[str, int] = defaultdict(int)

    def wrap(self, obj, name: str, label: str) -> None:
        orig = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.t[label] += time.perf_counter() - t0
                self.n[label] += 1

        setattr(obj, name, timed)

    def take(self) -> Dict[str, float]:
        out = dict(self.t)
        self.t.clear()
        self.n.clear()
        return out


def instrument_nixl(timer: StageTimer) -> None:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    tm = get_tensor_transport_manager("NIXL")
    agent = tm.get_nixl_agent()
    timer.wrap(tm, "fetch_multiple_tensors", "fetch_setup")  # everything up to the posted transfer
    timer.wrap(tm, "wait_fetch_complete", "wait_copy")
    timer.wrap(tm, "_add_tensor_descs", "local_registration")
    timer.wrap(agent, "add_remote_agent", "load_remote_metadata")
    timer.wrap(agent, "deserialize_descs", "descriptors")
    timer.wrap(agent, "get_xfer_descs", "descriptors")
    timer.wrap(agent, "initialize_xfer", "prepare_transfer")
    timer.wrap(agent, "transfer", "post_transfer")
    timer.wrap(agent, "release_xfer_handle", "release")


GET_TIMEOUT_S = 300.0


def get(refs, timeout: Optional[float] = None):
    """``ray.get`` that never waits forever."""
    return ray.get(refs, timeout=GET_TIMEOUT_S if timeout is None else timeout)


def gpu_share(args) -> float:
    """GPUs each actor asks for: 1, or half of GPU 0 when colocated."""
    if args.device != "cuda":
        return 0
    return 0.5 if args.same_gpu else 1


def transport_name(kind: str) -> str:
    return "nixl" if kind == "nixl" else "SGLANG_IPC"


# --------------------------------------------------------------------------- #
# Actors
# --------------------------------------------------------------------------- #
class GcLog:
    """Python garbage collections of this process, as (start, seconds, generation)."""

    def __init__(self):
        import gc

        self.events: List[Tuple[float, float, int]] = []
        self._t0 = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        now = time.perf_counter()
        if phase == "start":
            self._t0 = now
        elif self._t0 is not None:
            self.events.append((self._t0, now - self._t0, int(info.get("generation", -1))))
            self._t0 = None

    def between(self, t0: float, t1: float) -> List[Tuple[float, float, int]]:
        return [e for e in self.events if t0 <= e[0] <= t1]


def group_by_bytes(sizes: List[int], bucket_bytes: int) -> List[List[int]]:
    """Consecutive indices of ``sizes`` in groups of at most ``bucket_bytes``
    (a larger item gets a group of its own)."""
    out: List[List[int]] = []
    cur: List[int] = []
    size = 0
    for i, n in enumerate(sizes):
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


class _Side:
    def _setup(self, specs, device_kind: str, register_ipc: bool):
        import faulthandler

        faulthandler.enable()  # a crash leaves a Python stack in the worker's .err log
        light_sglang()
        from sglang.srt.ray.rdt.transport.nixl_progress import configure_nixl_progress_thread

        # as the product's processes do (SGLANG_RDT_NIXL_PROGRESS_DELAY_US=0 via
        # --actor-env measures NIXL's own busy-polling progress thread)
        configure_nixl_progress_thread()
        if register_ipc:
            from sglang.srt.ray.rdt.transport import sglang_ipc

            sglang_ipc.register()
        if device_kind == "cuda":
            idx = int(ray.get_gpu_ids()[0])
            self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
        self.names = [n for n, _, _ in specs]
        self.tensors = [torch.empty(s, dtype=d, device=self.device) for _, s, d in specs]
        self.pattern = Pattern(self.tensors)
        sync(self.device)
        self.pg = None

    # receivers: poison the targets before a pull, check every byte after it
    def poison(self, seed: int):
        self.pattern.fill(self.tensors, seed + 7919)
        sync(self.device)
        return True

    def verify(self, seed: int):
        sync(self.device)
        bad = self.pattern.check(self.tensors, seed)
        return {"ok": not bad, "bad": [self.names[i] for i in bad[:5]], "nbad": len(bad)}

    def mem_mark(self):
        """Start measuring this process's extra GPU memory (torch allocator)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mem_base = torch.cuda.memory_allocated(self.device)
        return True

    def mem_peak(self):
        """Peak allocated bytes since mem_mark, over what was allocated then."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.max_memory_allocated(self.device) - self._mem_base

    def where(self):
        return {"device": str(self.device), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()[:8],
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}

    # NCCL, sglang's update_weights_from_distributed pattern
    def nccl_init(self, port: int, rank: int):
        import torch.distributed as dist

        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank,
            device_id=self.device,
        )
        self.pg = dist.group.WORLD
        return True

    def nccl_close(self):
        import torch.distributed as dist

        if self.pg is not None:
            dist.destroy_process_group()
            self.pg = None

    def _buckets(self, bucket_bytes: int) -> List[List[int]]:
        return group_by_bytes([t.numel() * t.element_size() for t in self.tensors], bucket_bytes)

    def _barrier(self):
        import torch.distributed as dist

        x = torch.ones(1, device=self.device)
        dist.all_reduce(x)
        torch.cuda.synchronize(self.device)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Sender(_Side):
    def __init__(self, specs, device_kind, register_ipc=False):
        self._setup(specs, device_kind, register_ipc)
        self.refs = []

    def register(self):
        from ray.experimental import register_nixl_memory
        from ray.experimental.rdt.util import get_tensor_transport_manager

        t0 = time.perf_counter()
        get_tensor_transport_manager("NIXL").get_nixl_agent()
        t1 = time.perf_counter()
        for t in self.tensors:
            register_nixl_memory(t)
        return {"agent_seconds": t1 - t0, "seconds": time.perf_counter() - t1}

    def fill(self, seed: int):
        self.pattern.fill(self.tensors, seed)
        sync(self.device)
        return True

    def put(self, kind: str):
        t0 = time.perf_counter()
        ref = ray.put(self.tensors, _tensor_transport=transport_name(kind))
        dt = time.perf_counter() - t0
        self.refs.append(ref)
        info = {"put_seconds": dt}
        meta = ray._private.worker.global_worker.rdt_manager.get_rdt_metadata(ref.hex())
        tm = meta.tensor_transport_meta if meta is not None else None
        nixl = getattr(tm, "nixl", tm) if tm is not None else None
        if nixl is not None and getattr(nixl, "nixl_agent_meta", None) is not None:
            info["nixl_agent_meta_bytes"] = len(nixl.nixl_agent_meta)
            info["nixl_descs_bytes"] = len(nixl.nixl_serialized_descs or b"")
        ipc = getattr(tm, "ipc", None)
        if ipc is not None:
            info["ipc_segments"] = len(ipc.segments)
        elif getattr(tm, "ipc_unavailable", None):
            info["ipc_unavailable"] = tm.ipc_unavailable
        return [ref], info

    def drop(self):
        self.refs.clear()
        return True

    def nccl_send(self, bucket_bytes: int, iters: int):
        import torch.distributed as dist

        times = []
        for _ in range(iters):
            self._barrier()
            t0 = time.perf_counter()
            for bucket in self._buckets(bucket_bytes):
                hs = [dist.broadcast(self.tensors[i], src=0, async_op=True) for i in bucket]
                for h in hs:
                    h.wait()
            torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return times


@ray.remote(num_cpus=0, max_concurrency=2, enable_tensor_transport=True)
class Receiver(_Side):
    def __init__(self, specs, device_kind, register_ipc=False, pull_timeout_s=120.0):
        self._setup(specs, device_kind, register_ipc)
        from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver

        params = dict(zip(self.names, self.tensors))
        self.receiver = RdtWeightReceiver(
            lambda: params,
            device=self.device if self.device.type == "cuda" else None,
            pull_timeout_s=pull_timeout_s,
        )
        self.timer = StageTimer()
        self._instrumented = False

    def register(self):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        t0 = time.perf_counter()
        get_tensor_transport_manager("NIXL").get_nixl_agent()  # first NIXL use in the process
        agent_s = time.perf_counter() - t0
        out = dict(self.receiver.register())
        out["agent_seconds"] = agent_s
        if not self._instrumented:
            instrument_nixl(self.timer)
            self._instrumented = True
        return out

    def accept_ipc_refs(self):
        """Nothing to change since receiver.py accepts SGLANG_IPC refs itself;
        kept so older drivers work. Returns the transports it accepts."""
        from sglang.srt.ray.rdt.defaults import PULLABLE_TRANSPORTS

        return list(PULLABLE_TRANSPORTS)

    def ipc_config(self, cache=None, engine=None, streams=None, method=None):
        from sglang.srt.ray.rdt.transport import sglang_ipc

        t = sglang_ipc.transport()
        if cache is not None:
            t.cuda_ipc.cache.enabled = cache
            if not cache:
                sglang_ipc.close_ipc_mappings()
        if engine is not None and engine != t.cuda_ipc.engine:
            sglang_ipc.close_ipc_mappings()  # mappings live in the engine's context
            t.cuda_ipc.engine = engine
        if streams is not None:
            t.cuda_ipc.nstreams = streams
            if hasattr(t.cuda_ipc, "same_gpu_streams"):
                t.cuda_ipc.same_gpu_streams = streams
            if self.device.type == "cpu":  # on CPU: reader threads of process_vm_readv
                from sglang.srt.ray.rdt.transport.cma import CmaReader

                if t.cma._reader is not None:
                    t.cma._reader.close()
                t.cma._reader = CmaReader(threads=streams)
        ipc = t.cuda_ipc
        if method is not None:
            ipc.method = method
            if hasattr(ipc, "same_gpu_method"):
                ipc.same_gpu_method = method
        if self.device.type == "cpu":
            return {"engine": "cma", "streams": t.cma.reader().threads,
                    "method": "process_vm_readv", "cache": False, **t.mapping_stats()}
        return {"engine": ipc.engine, "streams": ipc.nstreams, "method": ipc.method,
                "cache": ipc.cache.enabled, **t.mapping_stats()}

    def pointers(self):
        return [t.data_ptr() for t in self.tensors]

    def pull(self, refs, names, kind: str):
        dev = self.device
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            free0 = torch.cuda.mem_get_info(dev)[0]
        self.timer.take()
        t0 = time.perf_counter()
        stats = self.receiver.pull(refs, names)
        wall = time.perf_counter() - t0
        # Each bench pull is an update of its own (senders differ between paths).
        self.receiver.state.end()
        stats = dict(stats)
        stats["wall_seconds"] = wall
        stats["stages"] = self.timer.take()
        if cuda:
            stats["peak_extra_bytes"] = torch.cuda.max_memory_allocated(dev) - base
            stats["device_used_delta_bytes"] = free0 - torch.cuda.mem_get_info(dev)[0]
        if kind == "ipc":
            from sglang.srt.ray.rdt.transport import sglang_ipc

            info = sglang_ipc.fetch_info(refs[-1]) or sglang_ipc.last_fetch()
            stats["transport"] = f"{sglang_ipc.TRANSPORT_NAME}/{info.path}"
            stats["ipc"] = dict(info.__dict__)
            stats["ipc_mappings"] = sglang_ipc.transport().mapping_stats()
        return stats

    def nccl_recv(self, bucket_bytes: int, iters: int):
        import torch.distributed as dist

        out = []
        for _ in range(iters):
            self._barrier()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            t0 = time.perf_counter()
            bcast = 0.0
            for bucket in self._buckets(bucket_bytes):
                tb = time.perf_counter()
                bufs = [torch.empty_like(self.tensors[i]) for i in bucket]
                hs = [dist.broadcast(b, src=0, async_op=True) for b in bufs]
                for h in hs:
                    h.wait()
                torch.cuda.synchronize(self.device)
                bcast += time.perf_counter() - tb
                for i, b in zip(bucket, bufs):  # load_weights: copy into the parameter
                    self.tensors[i].copy_(b)
                del bufs
            torch.cuda.synchronize(self.device)
            out.append({
                "seconds": time.perf_counter() - t0, "broadcast_seconds": bcast,
                "peak_extra_bytes": torch.cuda.max_memory_allocated(self.device) - base,
            })
        return out


# --------------------------------------------------------------------------- #
# Ceilings, in the driver
# --------------------------------------------------------------------------- #
def median_time(fn, reps: int, warmup: int = 1) -> Tuple[float, List[float]]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def cuda_ceilings(specs, src_idx: int, dst_idx: int, reps: int, streams: List[int]) -> Dict[str, Any]:
    d0, d1 = torch.device("cuda", src_idx), torch.device("cuda", dst_idx)
    src = [torch.empty(s, dtype=d, device=d0) for _, s, d in specs]
    dst = [torch.empty(s, dtype=d, device=d1) for _, s, d in specs]
    Pattern(src).fill(src, 1)  # not zeros
    nbytes = sum(t.numel() * t.element_size() for t in src)
    out: Dict[str, Any] = {"bytes": nbytes}

    def sync_both():
        torch.cuda.synchronize(d0)
        torch.cuda.synchronize(d1)

    def copied_ok(fn) -> bool:
        """Zero the targets, run one copy, compare every bit (bf16 patterns hold NaNs)."""
        for d in dst:
            d.zero_()
        sync_both()  # copies on other streams do not wait for zero_()
        fn()
        sync_both()
        return all(torch.equal(words_of(d), words_of(s).to(d.device)) for d, s in zip(dst, src))

    def torch_loop():
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        sync_both()

    same = src_idx == dst_idx
    kind = "device copy" if same else "peer copy"
    t, ts = median_time(torch_loop, reps)
    out["torch_per_tensor"] = {"seconds": t, "all": ts, "label": f"{kind}, per-tensor loop (torch copy_)"}
    out["torch_per_tensor_bytes_ok"] = copied_ok(torch_loop)
    if same:
        # the loop split over two streams (a same-GPU copy is SM/HBM bound, one
        # stream leaves gaps between tensors)
        st2 = [torch.cuda.Stream(device=d1) for _ in range(2)]

        def torch_loop2():
            cur = torch.cuda.current_stream(d1)
            for s in st2:
                s.wait_stream(cur)
            for i, (d, s_) in enumerate(zip(dst, src)):
                with torch.cuda.stream(st2[i % 2]):
                    d.copy_(s_, non_blocking=True)
            for s in st2:
                s.synchronize()

        t, ts = median_time(torch_loop2, reps)
        out["torch_per_tensor_2str"] = {"seconds": t, "all": ts,
                                        "label": f"{kind}, per-tensor loop, 2 streams (torch copy_)"}

    try:
        from sglang.srt.ray.rdt.transport import copy_plan, cuda_driver as cit

        drv = cit.driver()
        if not same:
            drv.enable_peer_access(dst_idx, src_idx)
            drv.enable_peer_access(src_idx, dst_idx)
        pairs = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size()) for d, s in zip(dst, src)]
        for engine, eng_idx in ((("pull", dst_idx),) if same else (("pull", dst_idx), ("push", src_idx))):
            for k in streams:
                strs = [torch.cuda.Stream(device=eng_idx) for _ in range(k)]
                queues = copy_plan.spread(pairs, k)

                def ce_loop():
                    drv.push(eng_idx)
                    try:
                        for q, st in zip(queues, strs):
                            h = st.cuda_stream
                            for dp, sp, n in q:
                                drv.memcpy_async(dp, sp, n, h)
                    finally:
                        drv.pop()
                    for st in strs:
                        st.synchronize()

                t, ts = median_time(ce_loop, reps)
                out[f"ce_{engine}_{k}"] = {"seconds": t, "all": ts,
                                           "label": f"copy engine {engine}, per-tensor, {k} stream(s)"}
            st = torch.cuda.Stream(device=eng_idx)

            def batch():
                drv.push(eng_idx)
                try:
                    cit.memcpy_batch_async(drv, pairs, st.cuda_stream, src_idx, dst_idx)
                finally:
                    drv.pop()
                st.synchronize()

            try:
                t, ts = median_time(batch, reps)
                out[f"batch_{engine}"] = {"seconds": t, "all": ts,
                                          "label": f"copy engine {engine}, one cuMemcpyBatchAsync"}
                out[f"batch_{engine}_bytes_ok"] = copied_ok(batch)
            except Exception as e:
                out[f"batch_{engine}_error"] = f"{type(e).__name__}: {e}"
            try:
                table = cit.chunk_table(pairs)
                for bps in (1, 2, 4):
                    def kern():
                        cit.sm_copy(pairs, eng_idx, st.cuda_stream, blocks_per_sm=bps, table=table)

                    t, ts = median_time(kern, reps)
                    out[f"kernel_{engine}_{bps}"] = {
                        "seconds": t, "all": ts,
                        "label": f"SM copy kernel {engine}, one launch, {bps} block(s)/SM"}
                out[f"kernel_{engine}_bytes_ok"] = copied_ok(
                    lambda: cit.sm_copy(pairs, eng_idx, st.cuda_stream, table=table))
            except Exception as e:
                out[f"kernel_{engine}_error"] = f"{type(e).__name__}: {e}"[:500]
    except Exception as e:  # pragma: no cover - reported, not fatal
        out["ce_error"] = f"{type(e).__name__}: {e}"
    del src, dst
    torch.cuda.empty_cache()

    bs = torch.empty(nbytes, dtype=torch.uint8, device=d0)
    bd = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    bs.fill_(0x5A)

    def one():
        bd.copy_(bs, non_blocking=True)
        sync_both()

    t, ts = median_time(one, reps)
    out["torch_one_tensor"] = {"seconds": t, "all": ts, "label": f"{kind}, one tensor (torch copy_)"}
    del bs, bd
    torch.cuda.empty_cache()
    return out


def cpu_ceilings(specs, reps: int) -> Dict[str, Any]:
    src = [torch.empty(s, dtype=d) for _, s, d in specs]
    dst = [torch.empty(s, dtype=d) for _, s, d in specs]
    Pattern(src).fill(src, 1)
    for t in dst:
        t.zero_()  # touch the pages, as live parameters are
    nbytes = sum(t.numel() * t.element_size() for t in src)
    out: Dict[str, Any] = {"bytes": nbytes}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)

        def loop():
            for d, s in zip(dst, src):
                d.copy_(s)

        t, ts = median_time(loop, reps)
        out["memcpy_per_tensor_1thread"] = {"seconds": t, "all": ts}
        bs = torch.cat([s.reshape(-1).view(torch.uint8) for s in src])
        bd = torch.zeros_like(bs)
        t, ts = median_time(lambda: bd.copy_(bs), reps)
        out["memcpy_one_tensor_1thread"] = {"seconds": t, "all": ts}
        torch.set_num_threads(threads)
        t, ts = median_time(lambda: bd.copy_(bs), reps)
        out[f"memcpy_one_tensor_{threads}threads"] = {"seconds": t, "all": ts}
    finally:
        torch.set_num_threads(threads)
    return out


class FlatModel(torch.nn.Module):
    """A "model" whose parameters are the given tensors under the given names
    (names with dots, as a real model's; no copies)."""

    def __init__(self, names, tensors):
        super().__init__()
        self._flat = [(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in zip(names, tensors)]

    def named_parameters(self, *args, **kwargs):
        return iter(self._flat)


# The SchedulerActor's Ray options (actor_options.RDT_ACTOR_MAX_CONCURRENCY).
RANK_MAX_CONCURRENCY = 8


@ray.remote(num_cpus=0, max_concurrency=RANK_MAX_CONCURRENCY, enable_tensor_transport=True)
class ClientRank(_Side):
    """A rollout rank as ``WeightSyncClient`` sees it, on the SchedulerActor's
    own code path: the rank core (:class:`RankWeightSync`) behind a
    :class:`ModelPort`, every pull/finalize hopping to a serving loop thread
    through the same safe-point queue sglang's event loop serves
    (``engine/standalone.py``). Generation is "paused" (as an engine is after
    ``/pause_generation``), so the client finalizes each update itself, as it
    does against a paused engine."""

    def __init__(self, specs, device_kind):
        self._setup(specs, device_kind, True)
        from sglang.srt.ray.rdt.engine.standalone import standalone_rank
        from sglang.srt.ray.rdt.transport import sglang_ipc

        self.sync = standalone_rank(
            FlatModel(self.names, self.tensors),
            device=self.device if self.device.type == "cuda" else None,
            pull_timeout_s=120.0, transports=["NIXL", sglang_ipc.register()],
        )
        self.sync.port.is_paused = True
        self.pulls: List[Dict[str, Any]] = []
        self.gclog = GcLog()

    def register_weight_for_rdt(self):
        return self.sync.receiver.register()

    def get_parameter_layout(self):
        return self.sync.parameter_layout()

    def get_parallelism_config(self):
        return {"rank": 0, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                "device": self.device.type}

    def get_weight_sync_status(self):
        return self.sync.status()

    def pull_weights(self, refs, names, timeout=None, finalize=None):
        t_enter = time.perf_counter()
        stats = self.sync.pull(refs, names, timeout, finalize)
        from sglang.srt.ray.rdt.transport import sglang_ipc

        info = sglang_ipc.fetch_info(refs[0])
        if info is not None:
            stats = {**stats, "ipc": {k: getattr(info, k) for k in (
                "path", "opened", "reused", "open_seconds", "copy_seconds", "seconds", "plan")}}
        stats["t_enter"] = t_enter
        stats["t_exit"] = time.perf_counter()
        self.pulls.append(stats)
        return stats

    def prepare_pull_weights(self, refs, names):
        return self.sync.prepare(refs, names)

    def noop(self):
        """A call that does no weight work on this actor (the fixed-cost baseline)."""
        return {"t": time.perf_counter()}

    def gc_between(self, t0, t1):
        return self.gclog.between(t0, t1)

    def finalize_weight_update(self, weight_version=None, flush_cache=True):
        return self.sync.finalize(weight_version, flush_cache)

    def release_weight_sync_mappings(self, sender_token=None):
        return self.sync.release_sender(sender_token)

    def open_weight_sync_lane(self, sender_token):
        # Lane calls run this actor's pull_weights (the bench's per-pull stamps).
        return self.sync.open_lane(sender_token, pull=self.pull_weights)

    def abort_weight_update(self, reason="aborted"):
        return self.sync.abort(reason)

    def take_pulls(self):
        out, self.pulls = self.pulls, []
        return out


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class ClientTrainer(_Side):
    """A trainer process holding the new weights, driving WeightSyncClient with
    its buckets in this process (``sender="local"``)."""

    def __init__(self, specs, device_kind):
        self._setup(specs, device_kind, True)
        self.gclog = GcLog()

    def _instrument(self, client, events: List[Tuple[str, float, float]]):
        """Stamp the client's sender calls (fill = slot copy + put), the
        device wait of each fill's copy, the put itself, and its waits on the
        ranks' pulls (``_gather``), on this host's perf_counter clock."""
        dev = self.device

        def stamp(label, fn):
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    events.append((label if not a or not isinstance(a[0], str) else f"{label}:{a[0]}",
                                   t0, time.perf_counter()))
            return timed

        pipe = client.pipeline
        pipe.sender_call = stamp("sender", pipe.sender_call)
        gather = pipe.gather

        def timed_gather(calls, phase, *a, **k):
            t0 = time.perf_counter()
            try:
                return gather(calls, phase, *a, **k)
            finally:  # waits on bucket pulls vs on other calls (finalize, status)
                events.append(("gather" if str(phase).startswith("pull") else "gather_other",
                               t0, time.perf_counter()))

        pipe.gather = timed_gather
        client._gather = timed_gather  # the zero-copy path gathers through the client
        from sglang.srt.ray.rdt.trainer import client as client_mod

        if hasattr(client_mod, "_put_direct"):
            orig_direct = getattr(client_mod._put_direct, "_orig", client_mod._put_direct)

            def put_direct(tensors):
                t0 = time.perf_counter()
                try:
                    return orig_direct(tensors)
                finally:
                    events.append(("put", t0, time.perf_counter()))

            put_direct._orig = orig_direct
            client_mod._put_direct = put_direct
        client.session.begin = stamp("begin", client.session.begin)
        client.session.end = stamp("end", client.session.end)
        sender = client.sender.sender
        if sender is not None and not isinstance(sender, ray.actor.ActorHandle):
            orig_put = sender._do_put

            def put(tensors):
                t0 = time.perf_counter()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # the slot copy, issued by fill
                t1 = time.perf_counter()
                try:
                    return orig_put(tensors)
                finally:
                    t2 = time.perf_counter()
                    events.append(("copy_wait", t0, t1))
                    events.append(("put", t1, t2))

            sender._do_put = put

    def put_ipc(self, seed: int):
        """The whole model as one SGLANG_IPC ref (IPC only, as zero-copy
        updates put it), owned by this process; returned nested."""
        from sglang.srt.ray.rdt.transport import sglang_ipc

        self.pattern.fill(self.tensors, seed)
        sync(self.device)
        with sglang_ipc.put_options(nixl=False if self.device.type == "cuda" else None):
            self._kept = ray.put(list(self.tensors), _tensor_transport="SGLANG_IPC")
        return [self._kept]

    def pid(self):
        return os.getpid()

    def miles(self, rank, bucket_bytes: int, rounds: int, seed0: int, transport: str = "SGLANG_IPC"):
        """miles' trainer loop, by hand: one registered bucket buffer; per
        bucket, stage the (HF-layout) tensors into it, synchronize, ray.put
        the views, pull_weights on the rank, wait for it; then finalize."""
        from ray.experimental import register_nixl_memory

        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()
        buckets = group_by_bytes(
            [(t.numel() * t.element_size() + 255) // 256 * 256 for t in self.tensors], bucket_bytes)
        cap = max(sum((self.tensors[i].numel() * self.tensors[i].element_size() + 255) // 256 * 256
                      for i in b) for b in buckets)
        buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
        register_nixl_memory(buf)
        views = []
        for b in buckets:
            off, vs = 0, []
            for i in b:
                t = self.tensors[i]
                nb = t.numel() * t.element_size()
                vs.append(buf[off:off + nb].view(t.dtype).view(t.shape))
                off += (nb + 255) // 256 * 256
            views.append(vs)
        ray.get(rank.register_weight_for_rdt.remote())
        out = []
        for r in range(rounds):
            seed = seed0 + r
            self.pattern.fill(self.tensors, seed)
            sync(self.device)
            ray.get(rank.poison.remote(seed))
            per = {"stage": 0.0, "sync": 0.0, "put": 0.0, "pull_call": 0.0}
            t_up = time.perf_counter()
            for b, vs in zip(buckets, views):
                t0 = time.perf_counter()
                for i, v in zip(b, vs):
                    v.copy_(self.tensors[i])
                t1 = time.perf_counter()
                sync(self.device)
                t2 = time.perf_counter()
                ref = ray.put(vs, _tensor_transport=transport_name(transport))
                t3 = time.perf_counter()
                ray.get(rank.pull_weights.remote([ref], [self.names[i] for i in b]))
                t4 = time.perf_counter()
                per["stage"] += t1 - t0
                per["sync"] += t2 - t1
                per["put"] += t3 - t2
                per["pull_call"] += t4 - t3
                del ref
            t_tr = time.perf_counter() - t_up
            fin = ray.get(rank.finalize_weight_update.remote(f"m{r}"))
            t_all = time.perf_counter() - t_up
            nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
            out.append({"bytes": nbytes, "buckets": len(buckets), "transfer_seconds": t_tr,
                        "seconds": t_all, "gbps": nbytes / t_tr / GB, "per": per,
                        "check": ray.get(rank.verify.remote(seed)),
                        "ok": bool(fin.get("success"))})
        ray.get(rank.take_pulls.remote())
        return {"updates": out}

    def call_cost(self, rank, calls: int, transport: str = "SGLANG_IPC"):
        """The fixed cost of one ``pull_weights`` call on the rank core: ``calls``
        pulls of the workload's smallest tensor (a fresh ref each, as miles
        puts per bucket), next to as many no-op calls of the same actor, with
        every stage's stamp (perf_counter: one clock for the host)."""
        i = min(range(len(self.tensors)), key=lambda k: self.tensors[k].numel() * self.tensors[k].element_size())
        name, t = self.names[i], self.tensors[i]
        ray.get(rank.register_weight_for_rdt.remote())
        for _ in range(5):  # warm-up: plans, mappings, Ray's code paths
            ray.get(rank.noop.remote())
            ref = ray.put([t], _tensor_transport=transport_name(transport))
            ray.get(rank.pull_weights.remote([ref], [name]))
        ray.get(rank.take_pulls.remote())
        noop, rows = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(rank.noop.remote())
            noop.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = ray.put([t], _tensor_transport=transport_name(transport))
            t1 = time.perf_counter()
            st = ray.get(rank.pull_weights.remote([ref], [name]))
            t2 = time.perf_counter()
            tm = st["timing"]
            rows.append({
                "put": t1 - t0, "call": t2 - t1,
                "dispatch": st["t_enter"] - t1,
                "to_loop": tm["started"] - tm["queued"],
                "enter_to_queue": tm["queued"] - st["t_enter"],
                "pull": tm["pull_end"] - tm["pull_start"],
                "loop_other": (tm["finished"] - tm["started"]) - (tm["pull_end"] - tm["pull_start"]),
                "back_from_loop": tm["resumed"] - tm["finished"],
                "actor_after": st["t_exit"] - tm["resumed"],
                "reply": t2 - st["t_exit"],
                "stages": st.get("stages", {}),
                "copy": (st.get("ipc") or {}).get("copy_seconds", 0.0),
                "bytes": st["bytes"],
            })
            del ref
        lane = self._lane_call_cost(rank, name, t, calls, transport)
        ray.get(rank.finalize_weight_update.remote("callcost"))
        ray.get(rank.take_pulls.remote())
        return {"name": name, "bytes": t.numel() * t.element_size(), "noop": noop, "pulls": rows,
                "lane": lane}

    def _lane_call_cost(self, rank, name, t, calls: int, transport: str):
        """The same pull of one kept ref, sent over the rank's call lane
        (``trainer/lane.py``) as WeightSyncClient does for zero-copy updates."""
        from sglang.srt.ray.rdt.trainer.lane import RankLink
        from sglang.srt.ray.rdt.transport import sglang_ipc

        if transport_name(transport) != "SGLANG_IPC":
            return None
        info = ray.get(rank.open_weight_sync_lane.remote(sglang_ipc.sender_token()))
        link = RankLink(info["address"], info["secret"], info["pid"])
        ref = ray.put([t], _tensor_transport="SGLANG_IPC")
        ray.get(rank.pull_weights.remote([ref], [name]))  # the rank holds the ref from here
        kw = {"ref_ids": [ref.hex()], "names": [name], "timeout": None}
        for _ in range(5):
            link.send("pull_weights", kw).result(60)
        ray.get(rank.take_pulls.remote())
        rows = []
        try:
            for _ in range(calls):
                t0 = time.perf_counter()
                st = link.send("pull_weights", kw).result(60)
                t1 = time.perf_counter()
                tm = st["timing"]
                rows.append({"call": t1 - t0, "pull": tm["pull_end"] - tm["pull_start"],
                             "to_loop": tm["started"] - tm["queued"],
                             "back_from_loop": tm["resumed"] - tm["finished"],
                             "copy": (st.get("ipc") or {}).get("copy_seconds", 0.0)})
        finally:
            link.close()
        return rows

    def run(self, rank, transport: str, bucket_bytes: int, rounds: int, seed0: int):
        from sglang.srt.ray.rdt.trainer.client import WeightSyncClient

        # TRANSPORT[:EXPORT][:nolane], e.g. SGLANG_IPC:buckets, SGLANG_IPC:nolane
        transport, *opts = transport.split(":")
        kw = {"lane": False} if "nolane" in opts else {}
        export = [o for o in opts if o != "nolane"]
        if export:
            kw["export"] = export[0]
        client = WeightSyncClient(
            [rank], names=["bench-rank"], sender="local", device=str(self.device),
            bucket_bytes=bucket_bytes, transport=transport, **kw,
        )
        self.mem_mark()
        t0 = time.perf_counter()
        # With the tensors: a zero-copy client puts them and the rank maps
        # them now (prepare_pull_weights), so the first update is a steady one.
        client.register(dict(zip(self.names, self.tensors)))
        register_s = time.perf_counter() - t0
        register_extra = self.mem_peak()
        events: List[Tuple[str, float, float]] = []
        self._instrument(client, events)
        out = []
        try:
            for r in range(rounds):
                seed = seed0 + r
                self.pattern.fill(self.tensors, seed)
                sync(self.device)
                ray.get(rank.poison.remote(seed))
                ray.get(rank.mem_mark.remote())
                events.clear()
                t_up0 = time.perf_counter()
                stats = client.update(dict(zip(self.names, self.tensors)), version=f"b{r}")
                t_up1 = time.perf_counter()
                d = stats.as_dict()
                d["trainer_extra_bytes"] = self.mem_peak()  # since before register(): slots included
                d["rank_extra_bytes"] = ray.get(rank.mem_peak.remote())
                d["t_start"], d["t_stop"] = t_up0, t_up1
                d["events"] = [(k, a - t_up0, b - a) for k, a, b in events]
                d["gc_trainer"] = [(a - t_up0, dt, g) for a, dt, g in self.gclog.between(t_up0, t_up1)]
                d["gc_rank"] = [(a - t_up0, dt, g) for a, dt, g in ray.get(rank.gc_between.remote(t_up0, t_up1))]
                bs = d.pop("buckets")
                d["nbuckets"] = len(bs)
                d["fill_seconds_mean"] = statistics.mean(b["fill_seconds"] for b in bs)
                d["bucket_pull_seconds_mean"] = statistics.mean(b["pull_seconds"] for b in bs)
                d["check"] = ray.get(rank.verify.remote(seed))
                d["rank_pulls"] = [
                    {**{k: p.get(k) for k in ("fetch_seconds", "seconds", "plan_seconds", "bytes", "transport",
                                              "ipc", "stages")},
                     "enter": p["t_enter"] - t_up0, "exit": p["t_exit"] - t_up0,
                     **{k: p["timing"][k] - t_up0 for k in ("pull_start", "queued", "started", "finished",
                                                            "resumed") if k in p["timing"]}}
                    for p in ray.get(rank.take_pulls.remote())
                ]
                out.append(d)
        finally:
            client.close()
        return {"register_seconds": register_s, "register_extra_bytes": register_extra, "updates": out}


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _last_line(err: Optional[str]) -> str:
    """The exception line of a (Ray-wrapped) error: the rank's own message."""
    lines = [ln.strip() for ln in (err or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_fault(wname: str, specs, args, log) -> Dict[str, Any]:
    """The trainer's process dies around a same-node (SGLANG_IPC) pull.

    (a) it dies after its put, before the rank reads: the pull must fail in
    bounded time with no byte written; (b) it is killed while the rank pulls:
    the pull either completes with every byte as put, or fails in bounded
    time and the rank reports its weights inconsistent; (c) the next full
    update from a new trainer lands, every byte checked, and the rank is
    consistent again. FAULT_CHECK says whether all held."""
    cuda = args.device == "cuda"
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if cuda else {}
    if os.environ.get(SRC_ENV):
        env[SRC_ENV] = os.environ[SRC_ENV]
    opts = {"num_gpus": gpu_share(args), "runtime_env": {"env_vars": env}}
    names = [n for n, _, _ in specs]
    rank = ClientRank.options(**opts).remote(specs, args.device)
    out: Dict[str, Any] = {}

    def pull(ref_list, bound_s=60.0):
        t0 = time.perf_counter()
        try:
            get(rank.pull_weights.remote(ref_list, names, 30.0), timeout=bound_s)
            err = None
        except Exception as e:  # the rank's error, or Ray's
            err = f"{type(e).__name__}: {e}"
        return err, time.perf_counter() - t0

    def consistent():
        return bool(get(rank.get_weight_sync_status.remote())["weights_consistent"])

    def end_update(version):
        try:
            return get(rank.finalize_weight_update.remote(version))
        except Exception as e:  # an update that ended inconsistent says so
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    def full_update(seed, version):
        """A complete update from a new trainer: every byte checked."""
        t = ClientTrainer.options(**opts).remote(specs, args.device)
        try:
            get(rank.poison.remote(seed))
            end_update(f"before-{version}")  # the earlier update ends (maybe inconsistent)
            err, dt = pull(get(t.put_ipc.remote(seed)))
            fin = end_update(version)
        finally:
            ray.kill(t)
        c = {"error": _last_line(err), "seconds": dt, "bytes_ok": get(rank.verify.remote(seed))["ok"],
             "consistent": consistent(), "weight_version": fin.get("weight_version")}
        c["ok"] = err is None and c["bytes_ok"] and c["consistent"]
        return c

    try:
        poison = 40_000
        get(rank.poison.remote(poison - 7919))  # the rank holds pattern(poison)
        t = ClientTrainer.options(**opts).remote(specs, args.device)
        refs, pid = get(t.put_ipc.remote(41_000)), get(t.pid.remote())
        ray.kill(t)
        deadline = time.monotonic() + 60
        while not _dead(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        err, dt = pull(refs)
        out["a_owner_dead_before_pull"] = a = {
            "error": _last_line(err), "seconds": dt,
            "unchanged": get(rank.verify.remote(poison))["ok"], "consistent": consistent()}
        a["ok"] = err is not None and dt < 30 and a["unchanged"]
        log(f"  fault (a) trainer dead before the pull: {'ok' if a['ok'] else 'NOT OK'} {a}")
        out["a_then_full_update"] = c = full_update(41_500, "after-a")
        log(f"  fault (a) then a full update: {'ok' if c['ok'] else 'NOT OK'} {c}")

        t = ClientTrainer.options(**opts).remote(specs, args.device)
        refs = get(t.put_ipc.remote(42_000))
        call = rank.pull_weights.remote(refs, names, 30.0)
        ray.kill(t)  # lands before, during or after the copy
        t0 = time.perf_counter()
        try:
            get(call, timeout=60)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        b = {"error": _last_line(err), "seconds": time.perf_counter() - t0,
             "consistent": consistent()}
        b["bytes_ok"] = get(rank.verify.remote(42_000))["ok"] if err is None else None
        # Completed: every byte as put; broken: bounded, and the rank says so.
        b["ok"] = bool(b["bytes_ok"] and b["consistent"]) if err is None else (
            b["seconds"] < 30 and not b["consistent"])
        out["b_killed_during_pull"] = b
        log(f"  fault (b) trainer killed during the pull: {'ok' if b['ok'] else 'NOT OK'} {b}")

        out["c_next_full_update"] = c = full_update(43_000, "after-fault")
        log(f"  fault (c) next full update: {'ok' if c['ok'] else 'NOT OK'} {c}")
    finally:
        ray.kill(rank)
    out["ok"] = all(out[k]["ok"] for k in ("a_owner_dead_before_pull", "a_then_full_update",
                                           "b_killed_during_pull", "c_next_full_update"))
    return out


def run_client(wname: str, specs, args, log) -> Dict[str, Any]:
    """WeightSyncClient end to end: a trainer actor on one device, a rank on the other."""
    cuda = args.device == "cuda"
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if cuda else {}
    if os.environ.get(SRC_ENV):
        env[SRC_ENV] = os.environ[SRC_ENV]
    env.update(dict(kv.split("=", 1) for kv in args.actor_env))
    opts = {"num_gpus": gpu_share(args), "runtime_env": {"env_vars": env}}
    out: Dict[str, Any] = {"bucket_bytes": int(args.client_bucket_mib * MiB)}
    trainer = ClientTrainer.options(**opts).remote(specs, args.device)
    rank = ClientRank.options(**opts).remote(specs, args.device)
    try:
        out["placement"] = {"trainer": get(trainer.where.remote()), "rank": get(rank.where.remote())}
        for j, transport in enumerate(args.client_transports):
            rounds = args.client_rounds or 1 + args.steady
            res = get(trainer.run.remote(rank, transport, out["bucket_bytes"], rounds, 900 + 100 * j),
                      timeout=900)
            out[transport] = res
            log(f"  client register ({transport}), with the tensors: {res['register_seconds'] * 1e3:.1f} ms")
            for i, u in enumerate(res["updates"]):
                log(f"  client update {i} ({transport}): {u['gbps']:.1f} GB/s transfer, "
                    f"{u['bytes'] / u['seconds'] / GB:.1f} GB/s whole update, {u['nbuckets']} buckets, "
                    f"transport={u['transport']} bytes_ok={u['check']['ok']}")
                log("    " + client_breakdown(u) + f"; extra MiB trainer {u['trainer_extra_bytes'] / MiB:.0f}"
                    f" rank {u['rank_extra_bytes'] / MiB:.0f}")
        if args.miles_rounds:
            res = get(trainer.miles.remote(rank, out["bucket_bytes"], args.miles_rounds, 5000), timeout=900)
            out["miles"] = res
            for i, u in enumerate(res["updates"]):
                log(f"  miles loop update {i}: {u['gbps']:.1f} GB/s transfer, "
                    f"{u['bytes'] / u['seconds'] / GB:.1f} GB/s with finalize, {u['buckets']} buckets, "
                    f"bytes_ok={u['check']['ok']}; per update ms: "
                    + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in u["per"].items()))
        if args.call_cost:
            res = get(trainer.call_cost.remote(rank, args.call_cost), timeout=600)
            out["call_cost"] = res
            log(f"  call cost ({res['name']}, {res['bytes']} B): " + call_cost_line(res))
    finally:
        ray.kill(trainer)
        ray.kill(rank)
    return out


def call_cost_line(res: Dict[str, Any]) -> str:
    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")

    rows = res["pulls"]
    parts = [f"no-op call p50 {q(res['noop'], .5) * 1e3:.3f} / p90 {q(res['noop'], .9) * 1e3:.3f} ms"]
    for k in ("call", "put", "dispatch", "enter_to_queue", "to_loop", "pull", "copy", "loop_other",
              "back_from_loop", "actor_after", "reply"):
        v = [r[k] for r in rows]
        parts.append(f"{k} p50 {q(v, .5) * 1e3:.3f} / p90 {q(v, .9) * 1e3:.3f}")
    stages = sorted({k for r in rows for k in r["stages"]})
    parts.append("receiver stages p50 " + ", ".join(
        f"{k} {q([r['stages'].get(k, 0.0) for r in rows], .5) * 1e3:.3f}" for k in stages))
    if res.get("lane"):
        lane = res["lane"]
        parts.append("LANE (the same ref again, over the call lane): " + ", ".join(
            f"{k} p50 {q([r[k] for r in lane], .5) * 1e3:.3f} / p90 {q([r[k] for r in lane], .9) * 1e3:.3f}"
            for k in ("call", "to_loop", "pull", "copy", "back_from_loop")))
    return "; ".join(parts)


def grep_worker_logs(pattern: str, limit: int = 4000) -> None:
    import glob
    import re

    rx = re.compile(pattern)
    out_dir = os.environ.get("OUT") or "."
    lines = []
    for f in sorted(glob.glob("/tmp/ray/session_latest/logs/worker-*")):
        try:
            with open(f, errors="replace") as fh:
                for line in fh:
                    if rx.search(line):
                        lines.append(f"{os.path.basename(f)}: {line.rstrip()}")
        except OSError:
            continue
    with open(os.path.join(out_dir, "worker_logs.txt"), "w") as fh:
        fh.write("\n".join(lines[:limit]) + "\n")
    print(f"worker logs: {len(lines)} lines matched {pattern!r}")


def client_breakdown(u: Dict[str, Any]) -> str:
    """Where one client update's time went (ms, summed over its buckets)."""
    ev = u.get("events") or []

    def total(prefix):
        return sum(dt for k, _, dt in ev if k == prefix) * 1e3

    pulls = u.get("rank_pulls") or []
    ipc = [p.get("ipc") or {} for p in pulls]
    rank_pull = sum(p.get("seconds") or 0 for p in pulls) * 1e3
    fetch = sum(p.get("fetch_seconds") or 0 for p in pulls) * 1e3
    copy = sum(x.get("copy_seconds") or 0 for x in ipc) * 1e3
    opened = sum(x.get("opened") or 0 for x in ipc)
    plans = ",".join(sorted({str(x.get("plan")) for x in ipc}))
    # the rank's method ran from enter to exit; time the rank spent outside
    # receiver.pull() in its own method is (exit - enter) - seconds
    rank_method = sum((p["exit"] - p["enter"]) for p in pulls) * 1e3
    gct = u.get("gc_trainer") or []
    gcr = u.get("gc_rank") or []
    parts = [
        f"whole {u['seconds'] * 1e3:.1f}", f"transfer {u['transfer_seconds'] * 1e3:.1f}",
        f"begin {total('begin'):.2f}", f"end {total('end'):.2f}",
        f"fill calls {total('sender:fill'):.2f} (slot-copy wait {total('copy_wait'):.2f}, put {total('put'):.2f})",
        f"release {total('sender:release'):.2f}", f"gather waits {total('gather'):.2f}",
        f"rank method {rank_method:.2f} / pull() {rank_pull:.2f} / fetch {fetch:.2f} / copy {copy:.2f}",
        f"mappings opened {opened}, plans {plans}",
    ]
    if gct or gcr:
        parts.append(f"gc trainer {[(round(a * 1e3, 1), round(d * 1e3, 2), g) for a, d, g in gct]} "
                     f"rank {[(round(a * 1e3, 1), round(d * 1e3, 2), g) for a, d, g in gcr]}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------- #
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipc_available() -> Optional[str]:
    try:
        from sglang.srt.ray.rdt.transport import sglang_ipc  # noqa: F401
    except Exception as e:
        return f"sglang.srt.ray.rdt.transport.sglang_ipc not importable: {e}"
    return None


def run_pulls(sender, receiver, names, kind: str, rounds: int, seed0: int, log) -> List[Dict[str, Any]]:
    out = []
    for r in range(rounds):
        seed = seed0 + r
        get([sender.fill.remote(seed), receiver.poison.remote(seed)])
        refs, put_info = get(sender.put.remote(kind))
        t0 = time.perf_counter()
        stats = get(receiver.pull.remote(refs, names, kind))
        stats["driver_seconds"] = time.perf_counter() - t0
        stats.update(put_info)
        stats["check"] = get(receiver.verify.remote(seed))
        get(sender.drop.remote())
        del refs
        out.append(stats)
        log(f"  {kind} pull {r}: {stats['bytes'] / stats['fetch_seconds'] / GB:8.1f} GB/s "
            f"(fetch {stats['fetch_seconds'] * 1e3:.1f} ms, total {stats['seconds'] * 1e3:.1f} ms) "
            f"bytes_ok={stats['check']['ok']} transport={stats.get('transport')}")
    return out


def run_workload(wname: str, specs, args, log) -> Dict[str, Any]:
    nbytes = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in specs)
    res: Dict[str, Any] = {"tensors": len(specs), "bytes": nbytes}
    cuda = args.device == "cuda"
    names = [n for n, _, _ in specs]
    errors = res.setdefault("errors", {})
    nixl_steady = args.steady if args.nixl_steady is None else args.nixl_steady

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # keep measuring the rest; the report shows it
            import traceback

            errors[name] = f"{type(e).__name__}: {e}"[:2000]
            log(f"[{wname}] {name} FAILED: {errors[name]}")
            log(traceback.format_exc()[-3000:])

    if cuda and not args.skip_ceiling:
        log(f"[{wname}] peer-copy ceiling in the driver ...")
        section("ceiling", lambda: res.__setitem__(
            "ceiling", cuda_ceilings(specs, 0, 0 if args.same_gpu else 1, args.reps, args.ceiling_streams)))
    elif not cuda:
        section("ceiling", lambda: res.__setitem__("ceiling", cpu_ceilings(specs, args.reps)))

    want_ipc = "ipc" in args.paths
    ipc_why = ipc_available() if want_ipc else None
    if want_ipc and ipc_why:
        res["ipc_skipped"] = ipc_why
        want_ipc = False
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if cuda else {}
    if os.environ.get(SRC_ENV):
        env[SRC_ENV] = os.environ[SRC_ENV]
    env.update(dict(kv.split("=", 1) for kv in args.actor_env))
    opts = {"num_gpus": gpu_share(args), "runtime_env": {"env_vars": env}}
    t0 = time.perf_counter()
    sender = Sender.options(**opts).remote(specs, args.device, want_ipc)
    get(sender.where.remote())
    receiver = Receiver.options(**opts).remote(specs, args.device, want_ipc)
    res["placement"] = {"sender": get(sender.where.remote()), "receiver": get(receiver.where.remote())}
    res["actors_seconds"] = time.perf_counter() - t0
    log(f"[{wname}] actors: {res['placement']}")
    try:
        if "pull" in args.paths or want_ipc:
            res["sender_register"] = get(sender.register.remote())
            res["receiver_register"] = get(receiver.register.remote())
        ptrs = get(receiver.pointers.remote())
        if "pull" in args.paths:
            log(f"[{wname}] NIXL pulls ...")
            section("pull", lambda: res.__setitem__(
                "pull", run_pulls(sender, receiver, names, "nixl", 1 + nixl_steady, 100, log)))

        def nccl():
            port = free_port()
            get([sender.nccl_init.remote(port, 0), receiver.nccl_init.remote(port, 1)], timeout=120)
            get([sender.fill.remote(300), receiver.poison.remote(300)])
            bb = int(args.nccl_bucket_mib * MiB)
            s_ref = sender.nccl_send.remote(bb, 1 + args.steady)
            r_out = get(receiver.nccl_recv.remote(bb, 1 + args.steady))
            get(s_ref)
            res["nccl"] = {"iters": r_out, "check": get(receiver.verify.remote(300)),
                           "bucket_bytes": bb}
            get([sender.nccl_close.remote(), receiver.nccl_close.remote()])
            log(f"  nccl: {[round(nbytes / x['broadcast_seconds'] / GB, 1) for x in r_out]} GB/s "
                f"bytes_ok={res['nccl']['check']['ok']}")

        def ipc():
            log(f"[{wname}] SGLANG_IPC pulls ...")
            get(receiver.accept_ipc_refs.remote())
            if cuda:
                variants = [(v.split(":") + ["ce"])[:3] for v in args.ipc_variants.split(",") if v]
            else:  # CPU: process_vm_readv with the default threads, then 1, 2 threads
                n = min(4, os.cpu_count() or 1)
                variants = [["cma", str(k), "cma"] for k in dict.fromkeys([n, 1, 2])]
            eng, nst, meth = variants[0]
            res["ipc_config"] = get(receiver.ipc_config.remote(engine=eng, streams=int(nst), method=meth))
            res["ipc"] = run_pulls(sender, receiver, names, "ipc", 1 + args.steady, 500, log)
            if cuda and args.ipc_nocache_rounds:
                get(receiver.ipc_config.remote(cache=False))
                res["ipc_nocache"] = run_pulls(sender, receiver, names, "ipc", args.ipc_nocache_rounds, 700, log)
                get(receiver.ipc_config.remote(cache=True))
            res["ipc_variants"] = {}
            for j, (eng, nst, meth) in enumerate(variants[1:]):
                key = f"{eng}:{nst}:{meth}"
                try:
                    cfg = get(receiver.ipc_config.remote(engine=eng, streams=int(nst), method=meth))
                    log(f"  variant {cfg}")
                    pulls = run_pulls(sender, receiver, names, "ipc", 1 + args.variant_rounds, 600 + 10 * j, log)
                    res["ipc_variants"][key] = pulls
                except Exception as e:
                    errors[f"ipc {key}"] = f"{type(e).__name__}: {e}"[:1000]
                    log(f"  variant {key} FAILED: {errors[f'ipc {key}']}")
                    if "ActorDiedError" in type(e).__name__:
                        break
            res["ipc_config_end"] = get(receiver.ipc_config.remote(engine=variants[0][0], streams=int(variants[0][1]), method=variants[0][2]))

        if cuda and "nccl" in args.paths:
            log(f"[{wname}] NCCL broadcast ...")
            section("nccl", nccl)
        if want_ipc:
            section("ipc", ipc)
        section("pointers", lambda: res.__setitem__(
            "pointers_unchanged", get(receiver.pointers.remote()) == ptrs))
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    if "client" in args.paths:
        log(f"[{wname}] WeightSyncClient updates ...")
        section("client", lambda: res.__setitem__("client", run_client(wname, specs, args, log)))
    if "fault" in args.paths:
        log(f"[{wname}] the trainer dies around a same-node pull ...")
        section("fault", lambda: res.__setitem__("fault", run_fault(wname, specs, args, log)))
    return res


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #
def _gbps(nbytes, s):
    return nbytes / s / GB if s else float("nan")


def summarize(res: Dict[str, Any], device: str) -> Dict[str, Any]:
    """Rows: (label, GB/s, extra receiver bytes or None, bytes ok or None)."""
    nbytes = res["bytes"]
    rows = []
    ceil = res.get("ceiling", {})
    ref_per, ref_one = None, None
    if device == "cuda":
        keys = ["torch_one_tensor", "torch_per_tensor"] + [
            k for k in ceil if k not in ("torch_one_tensor", "torch_per_tensor")]
        for k in keys:
            if isinstance(ceil.get(k), dict) and "label" in ceil[k]:
                ok = None
                if k.startswith(("kernel_", "batch_")):
                    ok = ceil.get(f"{k.split('_')[0]}_{k.split('_')[1]}_bytes_ok")
                elif k == "torch_per_tensor":
                    ok = ceil.get("torch_per_tensor_bytes_ok")
                rows.append((ceil[k]["label"], _gbps(nbytes, ceil[k]["seconds"]), None, ok))
        if "torch_per_tensor" in ceil:
            ref_per = _gbps(nbytes, ceil["torch_per_tensor"]["seconds"])
        if "torch_one_tensor" in ceil:
            ref_one = _gbps(nbytes, ceil["torch_one_tensor"]["seconds"])
    else:
        for k in ceil:
            if k.startswith("memcpy"):
                rows.append((k.replace("_", " "), _gbps(nbytes, ceil[k]["seconds"]), None, None))
        ref_per = _gbps(nbytes, ceil["memcpy_per_tensor_1thread"]["seconds"]) if "memcpy_per_tensor_1thread" in ceil else None
        ref_one = _gbps(nbytes, ceil["memcpy_one_tensor_1thread"]["seconds"]) if "memcpy_one_tensor_1thread" in ceil else None

    def pull_rows(key, label):
        pulls = res.get(key)
        if not pulls:
            return
        cold, steady = pulls[0], pulls[1:]
        rows.append((f"{label} cold", _gbps(nbytes, cold["fetch_seconds"]),
                     cold.get("peak_extra_bytes"), cold["check"]["ok"]))
        if steady:
            med = statistics.median(p["fetch_seconds"] for p in steady)
            rows.append((f"{label} steady (median of {len(steady)})", _gbps(nbytes, med),
                         max((p.get("peak_extra_bytes") or 0) for p in steady) if device == "cuda" else None,
                         all(p["check"]["ok"] for p in steady)))
            medt = statistics.median(p["seconds"] for p in steady)
            rows.append((f"{label} steady, whole pull()", _gbps(nbytes, medt), None, None))

    pull_rows("pull", "pull, NIXL")
    if res.get("nccl"):
        it = res["nccl"]["iters"][1:] or res["nccl"]["iters"]
        mb = statistics.median(x["broadcast_seconds"] for x in it)
        mt = statistics.median(x["seconds"] for x in it)
        peak = max(x["peak_extra_bytes"] for x in it)
        ok = res["nccl"]["check"]["ok"]
        mib = res["nccl"]["bucket_bytes"] // MiB
        rows.append((f"NCCL broadcast, {mib} MiB buckets (median of {len(it)})", _gbps(nbytes, mb), peak, ok))
        rows.append(("NCCL broadcast + copy into params (load_weights)", _gbps(nbytes, mt), peak, ok))
    cfg = res.get("ipc_config") or {}
    if device == "cuda":
        pull_rows("ipc", "pull, SGLANG_IPC" + (f" ({cfg['engine']}, {cfg['streams']} str, {cfg['method']})" if cfg else ""))
    else:
        pull_rows("ipc", "pull, SGLANG_IPC" + (f" (process_vm_readv, {cfg['streams']} thr)" if cfg else ""))
    for v, pulls in (res.get("ipc_variants") or {}).items():
        eng, nst, meth = v.split(":")
        med = statistics.median(p["fetch_seconds"] for p in pulls[1:] or pulls)
        what = f"process_vm_readv, {nst} thr" if eng == "cma" else f"{eng}, {nst} str, {meth}"
        rows.append((f"pull, SGLANG_IPC ({what}) median of {len(pulls[1:] or pulls)}",
                     _gbps(nbytes, med), max((p.get("peak_extra_bytes") or 0) for p in pulls),
                     all(p["check"]["ok"] for p in pulls)))
    if res.get("ipc_nocache"):
        pulls = res["ipc_nocache"]
        med = statistics.median(p["fetch_seconds"] for p in pulls)
        rows.append((f"pull, SGLANG_IPC, handles re-opened (median of {len(pulls)})", _gbps(nbytes, med),
                     max((p.get("peak_extra_bytes") or 0) for p in pulls), all(p["check"]["ok"] for p in pulls)))
    cl = res.get("client") or {}
    for transport in [k for k in cl if k not in ("bucket_bytes", "placement", "miles", "call_cost")]:
        ups = (cl.get(transport) or {}).get("updates") or []
        if not ups:
            continue
        steady = ups[1:] or ups
        mib = cl["bucket_bytes"] // MiB
        path = ",".join(sorted({u["transport"] for u in steady}))
        how = f"{mib} MiB buckets" if max(u["nbuckets"] for u in ups) > 1 or transport.endswith(":buckets") \
            else "zero-copy, one call"
        label = f"WeightSyncClient.update, {transport} ({path}), {how}"
        rows.append((f"{label}, first", ups[0]["gbps"], None, ups[0]["check"]["ok"]))
        rows.append((f"{label}, median of {len(steady)}", statistics.median(u["gbps"] for u in steady),
                     None, all(u["check"]["ok"] for u in steady)))
        if len(steady) >= 3:
            g = [u["gbps"] for u in steady]
            rows.append((f"  same, min / max of {len(steady)} (ratio to median {min(g) / statistics.median(g):.2f} "
                         f"/ {max(g) / statistics.median(g):.2f})", min(g), None, None))
            rows.append(("  same, max", max(g), None, None))
        w = [u["bytes"] / u["seconds"] / GB for u in steady]
        rows.append((f"  same, whole update() incl. session/finalize, median (min {min(w):.0f}, max {max(w):.0f}; "
                     f"first {ups[0]['bytes'] / ups[0]['seconds'] / GB:.0f}, first/median time "
                     f"{ups[0]['seconds'] / statistics.median(u['seconds'] for u in steady):.2f})",
                     statistics.median(w), None, None))
    ml = (cl.get("miles") or {}).get("updates") or []
    if ml:
        steady = ml[1:] or ml
        g = [u["gbps"] for u in steady]
        ok = all(u["check"]["ok"] for u in ml)
        rows.append((f"miles-shaped loop (SGLANG_IPC, one call per bucket), first", ml[0]["gbps"], None, ok))
        rows.append((f"miles-shaped loop, median of {len(steady)} (min {min(g):.0f}, max {max(g):.0f})",
                     statistics.median(g), None, ok))
        rows.append(("  same, with finalize", statistics.median(u["bytes"] / u["seconds"] / GB for u in steady),
                     None, None))
    return {"rows": rows, "ref_per_tensor": ref_per, "ref_one_tensor": ref_one}


def one_call_timeline(u: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """Where an update made of one pull call went (ms from the update's start):
    the client's own work before the call, the way to the rank's method, the
    hop to the rank's loop, the pull (its copy), the update's end, the rank's
    method after it, and the way back to the client and its bookkeeping."""
    pulls = u.get("rank_pulls") or []
    waits = [e for e in (u.get("events") or []) if e[0] == "gather"]
    if len(pulls) != 1 or len(waits) != 1:
        return None
    p, (_, g0, gdt) = pulls[0], waits[0]
    st = p.get("stages") or {}
    pull_end = p["pull_start"] + (p.get("seconds") or 0.0)
    fin = st.get("finalize", 0.0)
    return {k: v * 1e3 for k, v in {
        "client before the call": g0,
        "to the rank's method": p["enter"] - g0,
        "hop to the loop": p.get("started", p["pull_start"]) - p["enter"],
        "loop until the pull": p["pull_start"] - p.get("started", p["pull_start"]),
        "pull": p.get("seconds") or 0.0,
        "of which copy": ((p.get("ipc") or {}).get("copy_seconds") or 0.0),
        "update's end": fin,
        "rank after the end": p["exit"] - pull_end - fin,
        "of which hop back": p.get("resumed", 0.0) - p.get("finished", 0.0),
        "back to the client": g0 + gdt - p["exit"],
        "client after the call": u["t_stop"] - u["t_start"] - g0 - gdt,
        "whole": u["t_stop"] - u["t_start"],
    }.items()}


def one_call_timelines(cl: Dict[str, Any]) -> List[Tuple[str, str]]:
    out = []
    for transport, v in cl.items():
        ups = (v or {}).get("updates") if isinstance(v, dict) else None
        lines = [t for t in (one_call_timeline(u) for u in (ups or [])[1:]) if t]
        if lines:
            out.append((transport, "; ".join(
                f"{k} {statistics.median(t[k] for t in lines):.2f}" for k in lines[0])))
    return out


def stage_table(res: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    pulls = res.get("pull")
    if not pulls:
        return []
    cold, steady = pulls[0], pulls[1:] or pulls[:1]

    def med(key, src=None):
        vals = [(p.get(src) or {}).get(key, 0.0) if src else p.get(key, 0.0) for p in steady]
        return statistics.median(vals)

    def fmt(x):
        return f"{x * 1e3:9.2f} ms"

    rows = []
    rr = res.get("receiver_register") or {}
    sr = res.get("sender_register") or {}
    n = res.get("tensors")
    rows.append(("first NIXL use: agent + UCX init (receiver, once)", fmt(rr.get("agent_seconds", 0.0)), ""))
    rows.append((f"registration: receiver register(), {n} tensors (once)", fmt(rr.get("seconds", 0.0)), ""))
    rows.append(("first NIXL use: agent + UCX init (sender, once)", fmt(sr.get("agent_seconds", 0.0)), ""))
    rows.append((f"registration: sender register_nixl_memory x{n} (once)", fmt(sr.get("seconds", 0.0)), ""))
    rows.append(("metadata: sender ray.put (NIXL metadata)", fmt(cold["put_seconds"]), fmt(med("put_seconds"))))
    rows.append(("  NIXL agent metadata carried by the ref", f"{cold.get('nixl_agent_meta_bytes', 0) / 1024:9.1f} KiB", ""))
    rows.append(("metadata: receiver read + validate (plan)", fmt(cold["plan_seconds"]), fmt(med("plan_seconds"))))
    for k, label in (("load_remote_metadata", "handshake: add_remote_agent"),
                     ("descriptors", "handshake: descriptors"),
                     ("local_registration", "handshake: local registration lookup"),
                     ("prepare_transfer", "handshake: initialize_xfer"),
                     ("post_transfer", "copy: post transfer"),
                     ("wait_copy", "copy: wait until done"),
                     ("release", "release transfer handle")):
        rows.append((label, fmt(cold["stages"].get(k, 0.0)), fmt(med(k, "stages"))))
    other_c = cold["fetch_seconds"] - cold["stages"].get("fetch_setup", 0) - cold["stages"].get("wait_copy", 0)
    other_s = statistics.median(p["fetch_seconds"] - p["stages"].get("fetch_setup", 0) - p["stages"].get("wait_copy", 0) for p in steady)
    rows.append(("ray.get bookkeeping (fetch - setup - wait)", fmt(other_c), fmt(other_s)))
    rows.append(("= fetch (ray.get)", fmt(cold["fetch_seconds"]), fmt(med("fetch_seconds"))))
    rows.append(("= whole pull() on the receiver", fmt(cold["seconds"]), fmt(med("seconds"))))
    rows.append(("driver round trip of pull.remote()", fmt(cold["driver_seconds"]), fmt(med("driver_seconds"))))
    return rows


def print_report(results: Dict[str, Any], args) -> bool:
    all_ok = True
    fault_runs: List[bool] = []
    print()
    for wname, res in results["workloads"].items():
        s = summarize(res, args.device)
        head = res.get("describe", wname)
        print(f"=== {wname}: {head} ===")
        pl = res.get("placement", {})
        if pl:
            print(f"sender {pl['sender']['device']} -> receiver {pl['receiver']['device']}")
        ref_p, ref_o = s["ref_per_tensor"], s["ref_one_tensor"]
        print(f"{'path':<58} {'GB/s':>8} {'x per-tensor':>13} {'x one-tensor':>13} {'recv extra MiB':>15} {'bytes ok':>9}")
        for label, g, extra, ok in s["rows"]:
            xp = f"{g / ref_p:.2f}" if ref_p else "-"
            xo = f"{g / ref_o:.2f}" if ref_o else "-"
            ex = "-" if extra is None else f"{extra / MiB:.1f}"
            oks = "-" if ok is None else ("yes" if ok else "NO")
            if ok is False:
                all_ok = False
            gs = f"{g:8.1f}" if g >= 10 else f"{g:8.2f}"
            print(f"{label:<58} {gs} {xp:>13} {xo:>13} {ex:>15} {oks:>9}")
        for name, err in (res.get("errors") or {}).items():
            all_ok = False
            print(f"!! {name} failed: {err[:300]}")
        if res.get("ipc_skipped"):
            print(f"(SGLANG_IPC not run: {res['ipc_skipped']})")
        for k, v in res.get("ceiling", {}).items():
            if k.endswith("_error"):
                print(f"(ceiling {k}: {v[:300]})")
        st = stage_table(res)
        if st:
            print(f"\n{'NIXL pull stage (receiver unless noted)':<52} {'cold':>12} {'steady med':>12}")
            for label, c, m in st:
                print(f"{label:<52} {c:>12} {m:>12}")
        if res.get("ipc"):
            p = res["ipc"]
            print("\nSGLANG_IPC fetch: " + "; ".join(
                f"{'cold' if i == 0 else 'pull %d' % i}: path={x['ipc']['path']} opened={x['ipc']['opened']} "
                f"reused={x['ipc']['reused']} copies={x['ipc']['copies']} streams={x['ipc']['streams']} "
                f"open={x['ipc']['open_seconds'] * 1e3:.1f}ms copy={x['ipc']['copy_seconds'] * 1e3:.1f}ms"
                for i, x in enumerate(p[:2])))
        for transport, line in one_call_timelines(res.get("client") or {}):
            print(f"\none-call update timeline, {transport} (median ms of steady updates): {line}")
        cc = (res.get("client") or {}).get("call_cost")
        if cc:
            print(f"\npull_weights fixed cost on the rank core ({cc['name']}, {cc['bytes']} B, "
                  f"{len(cc['pulls'])} calls), ms: " + call_cost_line(cc))
        if res.get("pointers_unchanged") is False:
            all_ok = False
            print("!! receiver tensors moved (data_ptr changed)")
        if res.get("fault") is not None:
            fault_runs.append(res["fault"]["ok"])
        print()
    if fault_runs:
        print("FAULT_CHECK:", "PASS" if all(fault_runs) else "FAIL")
        all_ok = all_ok and all(fault_runs)
    print("BYTE_CHECK:", "PASS" if all_ok else "FAIL")
    return all_ok


def dump(results, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--workloads", default=None,
                    help="comma list of uniform,model (default: both on cuda, uniform on cpu)")
    ap.add_argument("--uniform", default=None, help="NxMiB, default 256x32 (cuda) / 16x4 (cpu)")
    ap.add_argument("--model", default=None, help="preset (qwen3-4b, tiny) or a config dir; default qwen3-4b (cuda) / tiny (cpu)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--paths", default=None, help="comma list of pull,nccl,ipc,client,fault (default: all that apply but fault; client only on cuda)")
    ap.add_argument("--steady", type=int, default=5, help="steady pulls after the cold one")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each ceiling copy")
    ap.add_argument("--ceiling-streams", default="1,4", help="copy-engine ceiling stream counts")
    ap.add_argument("--nccl-bucket-mib", type=float, default=1024)
    ap.add_argument("--ipc-nocache-rounds", type=int, default=3)
    ap.add_argument("--ipc-variants", default="dst:1:batch,dst:1:ce,dst:4:ce,src:1:batch,dst:1:kernel",
                    help="SGLANG_IPC engine:streams:method (method: ce, batch, kernel); the first is the "
                    "headline (cold + steady), the others run 1 + --variant-rounds pulls each")
    ap.add_argument("--variant-rounds", type=int, default=3)
    ap.add_argument("--client-bucket-mib", type=float, default=1024,
                    help="bucket size of the WeightSyncClient path (paths: client)")
    ap.add_argument("--client-rounds", type=int, default=None,
                    help="updates per client transport (default 1 + --steady)")
    ap.add_argument("--client-transports", default="SGLANG_IPC,nixl",
                    help="WeightSyncClient transports to run (paths: client)")
    ap.add_argument("--nixl-steady", type=int, default=None,
                    help="steady NIXL pulls (default --steady; same GPU: 0, NIXL crawls there)")
    ap.add_argument("--same-gpu", action="store_true",
                    help="colocated: every actor on GPU 0 with num_gpus=0.5 (trainer and engine "
                    "sharing one GPU); no NCCL; ceilings are same-device copies")
    ap.add_argument("--log-grep", default=None,
                    help="regex: copy matching lines of the Ray workers' logs to $OUT/worker_logs.txt at the end")
    ap.add_argument("--miles-rounds", type=int, default=0,
                    help="paths client: also this many updates of a miles-shaped loop (one registered "
                    "bucket, stage + sync + ray.put + pull_weights + ray.get per bucket), SGLANG_IPC")
    ap.add_argument("--call-cost", type=int, default=0,
                    help="paths client: also this many pull_weights calls of the smallest tensor on the "
                    "rank core, next to no-op calls (the fixed cost per call, by stage)")
    ap.add_argument("--skip-ceiling", action="store_true")
    ap.add_argument("--actor-env", action="append", default=[], help="KEY=VALUE for the actors of every path (repeatable)")
    ap.add_argument("--json-out", default=None, help="write all numbers here (default $OUT/bench_pull.json if OUT is set)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.client_transports = [t for t in args.client_transports.split(",") if t]
    if args.same_gpu:
        if not cuda:
            raise SystemExit("--same-gpu needs --device cuda")
        if args.nixl_steady is None:
            args.nixl_steady = 0
    args.workloads = (args.workloads or ("uniform,model" if cuda else "uniform")).split(",")
    args.paths = (args.paths or ("pull,nccl,ipc,client" if cuda else "pull,ipc")).split(",")
    if args.same_gpu and "nccl" in args.paths:
        args.paths.remove("nccl")  # NCCL refuses two ranks on one GPU
    args.ceiling_streams = [int(x) for x in args.ceiling_streams.split(",") if x]
    uni = args.uniform or ("256x32" if cuda else "16x4")
    n_uni, mib_uni = uni.lower().split("x")
    model = args.model or ("qwen3-4b" if cuda else "tiny")
    dtype = DTYPES[args.dtype]
    if args.json_out is None and os.environ.get("OUT"):
        args.json_out = os.path.join(os.environ["OUT"], "bench_pull.json")

    def log(msg):
        print(msg, flush=True)

    if cuda:
        if torch.cuda.device_count() < (1 if args.same_gpu else 2):
            print("--device cuda needs two visible GPUs (or --same-gpu)", file=sys.stderr)
            return 2
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:true" in alloc.lower():
            log("warning: expandable_segments memory cannot be exported by CUDA IPC (NIXL falls back to TCP)")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
    if os.path.isdir(os.path.join(src, "sglang")):
        os.environ.setdefault(SRC_ENV, os.path.abspath(src))
    light_sglang()
    if "ipc" in args.paths and not ipc_available():
        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()  # before the actors are created
    t_start = time.perf_counter()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    else:
        ray.init(num_cpus=max(4, os.cpu_count() or 4), num_gpus=torch.cuda.device_count() if cuda else 0,
                 include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    results: Dict[str, Any] = {
        "argv": sys.argv, "device": args.device, "ray": ray.__version__, "torch": torch.__version__,
        "ray_init_seconds": time.perf_counter() - t_start, "workloads": {},
    }
    if cuda:
        results["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        for w in args.workloads:
            if w == "uniform":
                specs = uniform_workload(int(n_uni), float(mib_uni), dtype)
                desc = f"{n_uni} x {mib_uni} MiB {args.dtype}"
                extra = {}
            elif w == "model":
                specs, extra = model_workload(model, dtype)
                desc = (f"{extra['arch']} ({model}) in sglang layout, {extra['params'] / 1e9:.2f} B params, "
                        f"{len(specs)} tensors {args.dtype}")
            else:
                raise SystemExit(f"unknown workload {w}")
            nbytes = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in specs)
            desc += f", {nbytes / GiB:.2f} GiB"
            log(f"[{w}] {desc}")
            res = run_workload(w, specs, args, log)
            res["describe"] = desc
            res.update(extra)
            results["workloads"][w] = res
            if args.json_out:
                dump(results, args.json_out)
    finally:
        results["total_seconds"] = time.perf_counter() - t_start
        if args.json_out:
            dump(results, args.json_out)
        ray.shutdown()
        if args.log_grep:
            grep_worker_logs(args.log_grep)
    ok = print_report(results, args)
    print(f"total {results['total_seconds']:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
