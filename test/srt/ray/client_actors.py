"""Ray actors that stand in for an engine's ranks and its trainers when testing WeightSyncClient.

``FakeRank`` is the product's standalone rank (``StandaloneRank``: the
SchedulerActor's weight-sync API over the rank core, pulls hopping to a
serving-loop thread through the safe-point queue) over a toy model, behind a
scheduler port that tests can make slow or make refuse every pull — whichever
way the pull arrives (a Ray actor call or the rank's same-node lane), since
the core asks its port at the start of every pull. Generation counts as
paused (the caller's job).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import ray
import torch

from sglang.test.rdt_standalone import ModelPort, StandaloneRank


def deep_model(seed: int = 0, width: int = 32, depth: int = 6) -> torch.nn.Module:
    """Many small tensors, so a small bucket size gives many groups."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class ProbedPort(ModelPort):
    """A model port that logs when each pull starts and can be slow or refuse."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.delay_s = 0.0
        self.fail: Optional[str] = None
        self.starts: List[float] = []

    def idle(self) -> bool:
        # Asked at the start of every pull, on the loop thread, before any byte
        # is read: a slow rank reads its source only after this sleep.
        self.starts.append(time.time())
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError(self.fail)
        return True


class FakeRankBase(StandaloneRank):
    def __init__(self, rank: int, seed: int = 0):
        self.probe = ProbedPort(deep_model(seed))
        super().__init__(self.probe.model, rank=f"fake{rank}", pull_timeout_s=30, port=self.probe)
        self.index = rank

    def get_parallelism_config(self):
        return {"rank": self.index, "tp_rank": 0, "tp_size": 1, "dp_rank": self.index, "device": "cpu"}

    def configure(self, delay_s: Optional[float] = None, fail: Optional[str] = "keep"):
        if delay_s is not None:
            self.probe.delay_s = delay_s
        if fail != "keep":
            self.probe.fail = fail
        return True

    def state(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def log(self) -> Dict[str, Any]:
        """Pull starts, the version the last update ended with, the counters."""
        st = self._rdt_sync.state.status()
        return {"starts": list(self.probe.starts), "version": self.probe.version,
                "updates": st["updates"], "failures": dict(st["failures"]), "pulls": st["pulls"],
                "lane_calls": (self._rdt_sync.lane.status()["calls"] if self._rdt_sync.lane else 0)}


FakeRank = ray.remote(num_cpus=0, max_concurrency=8, enable_tensor_transport=True)(FakeRankBase)


@ray.remote(num_cpus=0)
class MetricsProbe:
    """Records weight-sync metrics in a Ray worker, as a SchedulerActor would."""

    def record(self, labels: Dict[str, Any]) -> bool:
        from sglang.srt.ray.rdt.engine import metrics

        metrics.configure(True, labels)
        metrics.record_pull({"bytes": 4096, "tensors": 3, "seconds": 0.02})
        metrics.record_update(0.5)
        metrics.record_failure("transfer")
        return metrics.enabled()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class NodeTrainer:
    """A trainer pinned to one Ray node that updates an engine with ``WeightSyncClient``."""

    def update(self, actors, names, url: str, model_dir: str, seed: int, version: str,
               transport: str = "auto") -> Dict[str, Any]:
        import os

        from sglang.srt.ray.rdt import WeightSyncClient
        from tiny_model import random_state_dict

        with WeightSyncClient(actors, names=names, url=url, transport=transport,
                              bucket_bytes=64 * 1024) as client:
            client.register()
            route = client.route()
            stats = client.update(random_state_dict(model_dir, seed), version=version, strict=True)
            status = client.status()
            rank_stats = ray.get([a.get_weight_sync_stats.remote() for a in actors], timeout=60)
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "lanes": sorted(route.lanes), "ref_transport": route.ref_transport,
            "stats": stats.as_dict(), "status": status, "rank_stats": rank_stats,
        }
