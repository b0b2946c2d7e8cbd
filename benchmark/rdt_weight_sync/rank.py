"""The benchmark's rollout rank: the product's own standalone rank, plus what a
benchmark needs around it (poison and check every byte, memory, the peer path).

:class:`BenchRank` *is* :class:`sglang.test.rdt_standalone.StandaloneRank`
— the SchedulerActor's weight-sync API over the rank core, its pulls hopping
to a serving-loop thread through the same safe-point queue sglang's event loop
serves — around a model whose parameters are the workload's tensors.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Sequence

import ray
import torch

from patterns import Pattern
from sglang.test.rdt_standalone import ModelPort, StandaloneRank

# The SchedulerActor's Ray options (actor_options.RDT_ACTOR_MAX_CONCURRENCY).
RANK_MAX_CONCURRENCY = 8


class FlatModel(torch.nn.Module):
    """A "model" whose parameters are the given tensors under the given names
    (names with dots, as a real model's)."""

    def __init__(self, names: Sequence[str], tensors: Sequence[torch.Tensor]):
        super().__init__()
        self._names = list(names)
        self.params = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in tensors])

    def named_parameters(self, *args, **kwargs):
        return iter(zip(self._names, self.params))


class BenchRank(StandaloneRank):
    def __init__(self, specs, device_kind: str, lora_specs=None):
        self.device = torch.device("cuda", int(ray.get_gpu_ids()[0])) if device_kind == "cuda" \
            else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)
        self.names = [n for n, _, _ in specs]
        self.tensors = [torch.empty(s, dtype=d, device=self.device) for _, s, d in specs]
        self.pattern = Pattern(self.tensors)
        self.lora_specs = lora_specs or []  # an adapter this rank takes (the LoRA rows)
        layout = {n.split(":", 1)[1]: tuple(s) for n, s, _ in self.lora_specs}
        super().__init__(FlatModel(self.names, self.tensors), device=str(self.device), rank="bench",
                         port=ModelPort(FlatModel(self.names, self.tensors), lora_layout=lambda config: layout))
        self.lora_pattern = None

    def poison(self, seed: int) -> bool:
        self.pattern.fill(self.tensors, seed + 7919)
        self._wait_device()
        return True

    def verify(self, seed: int) -> Dict[str, Any]:
        self._wait_device()
        bad = self.pattern.check(self.tensors, seed)
        return {"ok": not bad, "bad": [self.names[i] for i in bad[:5]], "nbad": len(bad)}

    def verify_lora(self, seed: int) -> Dict[str, Any]:
        """Whether the adapter's stash holds update ``seed``'s bytes (every byte checked)."""
        self._wait_device()
        stash = self._rdt_sync.lora.stashes.stashes["rl"]
        tensors = [stash.tensors[n.split(":", 1)[1]] for n, _, _ in self.lora_specs]
        if self.lora_pattern is None:
            self.lora_pattern = Pattern(tensors)
        bad = self.lora_pattern.check(tensors, seed)
        return {"ok": not bad, "nbad": len(bad), "apply_seconds": self._rdt_sync.port.lora_apply_seconds}

    def _wait_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def where(self) -> Dict[str, Any]:
        return {"device": str(self.device), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()[:8]}

    # -- the peer path: PyTorch's own CUDA IPC (what sglang's update_weights_from_tensor rides on)
    def peer_copy(self, handles: List[Any], names: List[str]) -> float:
        """Rebuild tensors shared with ``torch.multiprocessing``'s reductions
        and copy them into the parameters (one copy each)."""
        t0 = time.perf_counter()
        params = dict(zip(self.names, self.tensors))
        for (rebuild, args), name in zip(handles, names):
            params[name].copy_(rebuild(*args))
        self._wait_device()
        return time.perf_counter() - t0

    def peer_copy_bucket(self, handle, names: List[str], offsets: List[int]) -> float:
        """Rebuild one flattened bucket and copy each parameter's bytes out of it."""
        t0 = time.perf_counter()
        rebuild, args = handle
        bucket = rebuild(*args)
        params = dict(zip(self.names, self.tensors))
        for name, off in zip(names, offsets):
            p = params[name]
            p.view(-1).view(torch.uint8).copy_(bucket[off:off + p.nbytes])
        self._wait_device()
        del bucket
        return time.perf_counter() - t0


def rank_actor(device_kind: str, gpu_share: float):
    opts: Dict[str, Any] = {"num_cpus": 0, "max_concurrency": RANK_MAX_CONCURRENCY}
    if device_kind == "cuda":
        opts["num_gpus"] = gpu_share
    return ray.remote(enable_tensor_transport=True, **opts)(BenchRank)
