"""Ray actors of the GPU tests: a rank on GPU 0 and a trainer on GPU 0.

``GpuRank`` is the product's standalone rank (``StandaloneRank``: the
SchedulerActor's weight-sync API over the rank core) around a model of
``n`` float32 vectors on ``cuda:0``. ``GpuTrainer`` drives it with the
product's ``WeightSyncClient`` from another process on the same GPU: the
client's route is then *direct* (the rank reads the trainer's own tensors
over CUDA IPC through its call lane). Both are created with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so that each sees the GPU
without asking Ray for one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from typing import Any, Dict, List

import ray
import torch

from sglang.test.rdt_standalone import StandaloneRank


def pattern(numel: int, seed: int, index: int, device="cpu") -> torch.Tensor:
    """Update ``seed``'s bytes for tensor ``index``: whole numbers, exact in
    float32, so the test process computes the same bytes on the CPU."""
    return torch.arange(numel, dtype=torch.float32, device=device) + float(seed * 1000 + index)


def sha256(t: torch.Tensor) -> str:
    """What ``get_parameter_checksums()`` reports for a parameter holding ``t``."""
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def weight_names(n: int) -> List[str]:
    return [f"layers.{i}.weight" for i in range(n)]


class GpuRankBase(StandaloneRank):
    def __init__(self, n: int, numel: int, device: str = "cuda:0"):
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        model = torch.nn.ParameterDict({
            name.replace(".", "_"): torch.nn.Parameter(torch.zeros(numel, device=device), requires_grad=False)
            for name in weight_names(n)})
        super().__init__(_Named(model, weight_names(n)), device=device, rank="gpu", pull_timeout_s=60)

    def pointers(self) -> Dict[str, int]:
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}


class _Named(torch.nn.Module):
    """The ParameterDict's vectors under names with dots, as a real model's."""

    def __init__(self, params: torch.nn.ParameterDict, names: List[str]):
        super().__init__()
        self.params = params
        self._names = names

    def named_parameters(self, *args, **kwargs):
        return iter(zip(self._names, self.params.values()))


class _Collected(logging.Handler):
    """The messages of the records it is handed."""

    def __init__(self, level: int):
        super().__init__(level)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


GpuRank = ray.remote(num_cpus=0, max_concurrency=8, enable_tensor_transport=True)(GpuRankBase)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class GpuTrainer:
    """A trainer process on GPU 0 with one ``WeightSyncClient``."""

    def __init__(self, device: str = "cuda:0"):
        self.device = device
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.client = None
        self._warnings = _Collected(logging.WARNING)
        logging.getLogger("sglang.srt.ray.rdt.trainer.client").addHandler(self._warnings)

    def pid(self) -> int:
        return os.getpid()

    def connect(self, rank, **client_options) -> Dict[str, Any]:
        from sglang.srt.ray.rdt import WeightSyncClient

        self.client = WeightSyncClient([rank], names=["gpu-rank"], device=self.device, **client_options)
        self.client.register()
        route = self.client.route()
        return {"direct": route.direct, "lanes": sorted(route.lanes), "ref_transport": route.ref_transport,
                "why_not_direct": route.why_not_direct, "pool_bytes": self.client.pool_bytes()}

    def update(self, n: int, numel: int, seed: int, version: str, die_after_steps: int = 0,
               stream: bool = False, made: str = "pool", bad_name_at: int = -1,
               overwrite: bool = False) -> Dict[str, Any]:
        """One update of fresh tensors, ``made``: in the client's staging pool
        (``pool``, as a trainer's gather step makes them), or outside it by a
        ``clone`` (``outside``), fused from two halves with ``torch.cat``
        (``cat``) or as every other element of a buffer twice the size
        (``strided``: not contiguous); ``stream``: a generator that makes each
        in the pool as the update consumes it (``bad_name_at``: tensor k
        under a name the rank does not have). ``die_after_steps``: this
        process SIGKILLs itself once that many steps landed, while the next
        steps' pulls are in flight on the rank. ``overwrite``: every tensor is
        overwritten (-1) the moment ``update()`` returns or raises. Returns the
        client's figures, or the error it raised (type, cause's type, message)."""
        def make(i):
            t = pattern(numel, seed, i, self.device)
            if made == "cat":
                return torch.cat(t.chunk(2))
            if made == "strided":
                store = torch.full((2 * numel,), -1.0, device=self.device)
                store[::2].copy_(t)
                return store[::2]
            return t

        def generate():
            for i, name in enumerate(weight_names(n)):
                with self.client.staging():
                    yield ("no.such.parameter" if i == bad_name_at else name), make(i)

        if stream:
            named = generate()
        elif made == "pool":
            with self.client.staging():
                named = {name: make(i) for i, name in enumerate(weight_names(n))}
        else:
            named = {name: make(i) for i, name in enumerate(weight_names(n))}
        kept = [] if stream else list(named.values())

        def progress(step, done, total):
            if die_after_steps and done >= die_after_steps:
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            stats = self.client.update(named, version=version, progress=progress)
        except Exception as e:
            return {"error": type(e).__name__, "cause": type(getattr(e, "cause", None)).__name__,
                    "message": str(e)}
        finally:
            if overwrite:
                for t in kept:
                    t.fill_(-1.0)
                torch.cuda.synchronize(self.device)
        d = stats.as_dict()
        keys = ("path", "transport", "lane_calls", "tensors", "bytes", "held_bytes", "gathered_bytes")
        return {k: d[k] for k in keys} | {"steps": len(d["buckets"]), "pool_bytes": self.client.pool_bytes()}

    def client_warnings(self) -> List[str]:
        """The client's warnings logged in this process so far."""
        return list(self._warnings.messages)

    def update_then_overwrite(self, n: int, numel: int, seed: int, version: str) -> Dict[str, Any]:
        """One update of fresh tensors, then every one of them overwritten
        (-1) the moment ``update()`` returns, as a trainer reusing its memory
        would. Returns the steps' rank timing (``fence_seconds``: the client
        waited on the rank's copy)."""
        with self.client.staging():
            named = {name: pattern(numel, seed, i, self.device) for i, name in enumerate(weight_names(n))}
        stats = self.client.update(named, version=version)
        for t in named.values():
            t.fill_(-1.0)
        torch.cuda.synchronize(self.device)
        return {"steps": [dict(b.rank_timing) for b in stats.buckets], "transport": stats.transport}

    def put(self, n: int, numel: int, seed: int, registered: bool) -> List[Any]:
        """Update ``seed``'s tensors put with ``SGLANG_IPC`` as a trainer of its own puts them: views of one
        buffer registered with NIXL (``registered``, miles' bucket) or tensors made anywhere. Returns
        ``[ref]`` (the ref stays alive here until the next put)."""
        from ray.experimental import register_nixl_memory

        from sglang.srt.ray.rdt.transport import sglang_ipc

        sglang_ipc.register()
        tensors = [pattern(numel, seed, i, self.device) for i in range(n)]
        if registered:
            if getattr(self, "_bucket", None) is None:
                self._bucket = torch.empty(n, numel, device=self.device)
                register_nixl_memory(self._bucket)
            for view, t in zip(self._bucket.unbind(0), tensors):
                view.copy_(t)
            tensors = list(self._bucket.unbind(0))
        self._refs = [ray.put(tensors, _tensor_transport=sglang_ipc.TRANSPORT_NAME)]
        return self._refs

    def release(self) -> int:
        """``client.release()``; returns what the staging pool held before."""
        held = self.client.pool_bytes()
        self.client.release()
        return held

    def close(self) -> bool:
        if self.client is not None:
            self.client.close()
            self.client = None
        return True
