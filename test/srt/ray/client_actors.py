"""Plain Ray actors that stand in for an engine's ranks when testing WeightSyncClient.

``FakeRank`` answers the SchedulerActor calls the client makes
(``register_weight_for_rdt``, ``get_parameter_layout``, ``pull_weights``,
``finalize_weight_update``, ...) with the real rank core
(:class:`~sglang.srt.ray.rdt.engine.rank_sync.RankWeightSync`, the same code a
SchedulerActor runs, over a toy torch model whose loop thread serves the
safe-point queue), so pulls are real NIXL transfers into live tensors. It can
be slow (sleep before each pull reads the bucket) or fail, and it logs when
each pull started and ended. Generation counts as paused (the caller's job).

``SpySender`` is the client's bucket sender with a log of when each fill began.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import ray
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer.sender import BucketSender


def deep_model(seed: int = 0, width: int = 32, depth: int = 6) -> torch.nn.Module:
    """Many small tensors, so a small bucket size gives many buckets."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


@ray.remote(num_cpus=0, max_concurrency=4, enable_tensor_transport=True)
class FakeRank:
    def __init__(self, rank: int, seed: int = 0, delay_s: float = 0.0, fail: Optional[str] = None):
        from sglang.srt.ray.rdt.engine.standalone import standalone_rank
        from sglang.srt.ray.rdt.transport import sglang_ipc

        self.rank = rank
        self.model = deep_model(seed)
        self.sync = standalone_rank(
            self.model, rank=f"fake{rank}", pull_timeout_s=30,
            transports=["NIXL", sglang_ipc.register()],  # registered as the SchedulerActor does
        )
        self.sync.port.is_paused = True
        self.delay_s = delay_s
        self.fail = fail
        self.pulls: List[Dict[str, Any]] = []
        # A SchedulerActor runs pulls one at a time (at its scheduler's safe point).
        self.pull_lock = threading.Lock()
        self.finalized: List[Optional[str]] = []
        self.aborts: List[str] = []

    def configure(self, delay_s: Optional[float] = None, fail: Optional[str] = "keep"):
        if delay_s is not None:
            self.delay_s = delay_s
        if fail != "keep":
            self.fail = fail

    # --- the SchedulerActor API the client uses ------------------------- #
    def register_weight_for_rdt(self):
        return self.sync.receiver.register()

    def get_parameter_layout(self):
        return self.sync.parameter_layout()

    def get_parallelism_config(self):
        return {"rank": self.rank, "tp_rank": 0, "tp_size": 1, "dp_rank": self.rank, "device": "cpu"}

    def pull_weights(self, refs, names, timeout=None, finalize=None):
        with self.pull_lock:
            start = time.time()
            # The bucket is read only after this sleep: if the client wrote the
            # next bucket into the same buffer meanwhile, the wrong bytes land.
            time.sleep(self.delay_s)
            if self.fail:
                raise WeightSyncError(self.fail)
            stats = self.sync.pull(refs, names, timeout, finalize)
            if finalize is not None:  # ended the update in this call
                self.finalized.append(finalize.get("weight_version"))
            self.pulls.append({"names": list(names), "start": start, "end": time.time(),
                               "finalize": finalize, "plan_reused": stats["plan_reused"],
                               "thread": threading.current_thread().name})
            return stats

    def prepare_pull_weights(self, refs, names):
        return self.sync.prepare(refs, names)

    def finalize_weight_update(self, weight_version=None, flush_cache=True):
        self.finalized.append(weight_version)
        return self.sync.finalize(weight_version, flush_cache)

    def abort_weight_update(self, reason="aborted"):
        self.aborts.append(reason)
        return self.sync.abort(reason)

    def get_weight_sync_status(self):
        return self.sync.status()

    def release_weight_sync_mappings(self, sender_token=None):
        return self.sync.release_sender(sender_token)

    def open_weight_sync_lane(self, sender_token):
        # Lane calls run this actor's pull_weights (its delay, failure and log).
        return self.sync.open_lane(sender_token, pull=self.pull_weights)

    # --- inspection ------------------------------------------------------ #
    def state(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def log(self) -> Dict[str, Any]:
        return {"pulls": self.pulls, "finalized": self.finalized, "aborts": self.aborts}


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class SpySender(BucketSender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fills: List[Dict[str, Any]] = []

    def fill(self, slot, token, regions):
        self.fills.append({
            "slot": slot, "token": token, "start": time.time(),
            "names": [s[0] for _, slices, _ in regions for s in slices],
        })
        return super().fill(slot, token, regions)

    def fill_log(self):
        return self.fills


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
    """A trainer pinned to one Ray node that updates an engine with
    ``WeightSyncClient`` (buckets in this process: ``sender="local"``)."""

    def update(self, actors, names, url: str, model_dir: str, seed: int, version: str,
               transport: str = "auto") -> Dict[str, Any]:
        import os

        from sglang.srt.ray.rdt import WeightSyncClient
        from tiny_model import random_state_dict

        with WeightSyncClient(actors, names=names, url=url, sender="local",
                              transport=transport, bucket_bytes=64 * 1024) as client:
            client.register()
            put_transport = client.put_transport()
            stats = client.update(random_state_dict(model_dir, seed), version=version, strict=True)
            status = client.status()
            rank_stats = ray.get([a.get_weight_sync_stats.remote() for a in actors], timeout=60)
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "put_transport": put_transport,
            "stats": stats.as_dict(), "status": status, "rank_stats": rank_stats,
        }
