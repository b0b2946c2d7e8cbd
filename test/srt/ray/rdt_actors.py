"""Plain Ray actors around the receiver and a trainer, for tests and demos.

``ToyRank`` holds a small torch model and an :class:`RdtWeightReceiver`, exactly
as a SchedulerActor does, without sglang around it. ``ToyTrainer`` puts buckets
over NIXL and keeps them alive until told to drop them.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List

import ray
import torch


def checksum(tensors: Dict[str, torch.Tensor]) -> Dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in sorted(tensors.items())
    }


def toy_model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)
    )


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class ToyRank:
    def __init__(self, seed: int = 0, width: int = 64, pull_timeout_s: float = 30.0):
        from sglang.srt.ray.rdt.receiver import RdtWeightReceiver

        self.model = toy_model(seed, width)
        self.receiver = RdtWeightReceiver(
            lambda: dict(self.model.named_parameters()), pull_timeout_s=pull_timeout_s
        )

    def register(self):
        return self.receiver.register()

    def pull(self, refs, names, timeout_s=None):
        return self.receiver.pull(refs, names, timeout_s)

    def state(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def checksums(self):
        return checksum(dict(self.model.named_parameters()))

    def pointers(self):
        return {n: p.data_ptr() for n, p in self.model.named_parameters()}

    def status(self):
        return self.receiver.status()

    def make_noncontiguous(self, name: str):
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.t().contiguous().t()
        return p.is_contiguous()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class ToyTrainer:
    def __init__(self):
        self.buckets: List[List[torch.Tensor]] = []

    def put(self, tensors: List[torch.Tensor]):
        self.buckets.append(tensors)
        return [ray.put(tensors, _tensor_transport="nixl")]

    def put_plain(self, tensors: List[torch.Tensor]):
        return [ray.put(tensors)]

    def put_large(self, n: int, numel: int):
        ts = [torch.full((numel,), float(i + 1)) for i in range(n)]
        self.buckets.append(ts)
        return [ray.put(ts, _tensor_transport="nixl")]

    def drop(self):
        self.buckets.clear()
