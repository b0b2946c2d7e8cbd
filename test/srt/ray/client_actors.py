"""Plain Ray actors that stand in for an engine's ranks when testing WeightSyncClient.

``FakeRank`` answers the SchedulerActor calls the client makes
(``register_weight_for_rdt``, ``get_parameter_layout``, ``pull_weights``,
``finalize_weight_update``, ...) around a real :class:`RdtWeightReceiver` and a
toy torch model, so pulls are real NIXL transfers into live tensors. It can be
slow (sleep before each pull reads the bucket) or fail, and it logs when each
pull started and ended.

``SpySender`` is the client's bucket sender with a log of when each fill began.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import ray
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.sender import BucketSender


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
        from sglang.srt.ray.rdt import cuda_ipc_transport
        from sglang.srt.ray.rdt.receiver import RdtWeightReceiver

        cuda_ipc_transport.register()  # as the SchedulerActor does

        self.rank = rank
        self.model = deep_model(seed)
        self.receiver = RdtWeightReceiver(
            lambda: dict(self.model.named_parameters()), pull_timeout_s=30
        )
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
        return self.receiver.register()

    def get_parameter_layout(self):
        return {
            n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                "data_ptr": p.data_ptr()}
            for n, p in self.model.named_parameters()
        }

    def get_parallelism_config(self):
        return {"rank": self.rank, "tp_rank": 0, "tp_size": 1, "dp_rank": self.rank, "device": "cpu"}

    def pull_weights(self, refs, names, timeout=None):
        with self.pull_lock:
            start = time.time()
            # The bucket is read only after this sleep: if the client wrote the
            # next bucket into the same buffer meanwhile, the wrong bytes land.
            time.sleep(self.delay_s)
            if self.fail:
                raise WeightSyncError(self.fail)
            stats = self.receiver.pull(refs, names, timeout)
            self.pulls.append({"names": list(names), "start": start, "end": time.time()})
            return stats

    def finalize_weight_update(self, weight_version=None, flush_cache=True):
        self.finalized.append(weight_version)
        self.receiver.state.end()
        return {"success": True, "weight_version": weight_version}

    def abort_weight_update(self, reason="aborted"):
        self.aborts.append(reason)
        return self.receiver.state.abort(reason)

    def get_weight_sync_status(self):
        return {**self.receiver.status(), "transports": ["NIXL", "SGLANG_IPC"]}

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
        from sglang.srt.ray.rdt import metrics

        metrics.configure(True, labels)
        metrics.record_pull({"bytes": 4096, "tensors": 3, "seconds": 0.02})
        metrics.record_update(0.5)
        metrics.record_failure("transfer")
        return metrics.enabled()
