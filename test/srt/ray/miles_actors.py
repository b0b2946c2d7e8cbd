"""A trainer actor shaped like miles' RDT source rank (our code, miles' call shapes).

miles (radixark/miles PR #1313) declares its trainer actor *without*
``enable_tensor_transport=True``, registers one uint8 bucket per engine rank
with ``ray.experimental.register_nixl_memory`` once, and per round stages the
tensors of the round as contiguous views packed into that bucket, then
``ray.put(views, _tensor_transport="nixl")``; the rollout rank pulls with
``pull_weights.remote([ref], names)``; the bucket is restaged only after every
pull of the round returned.
"""

from __future__ import annotations

from typing import Dict, List

import ray
import torch


@ray.remote(num_cpus=0, max_concurrency=2)
class MilesLikeTrainer:
    def __init__(self, bucket_bytes: int):
        from ray.experimental import register_nixl_memory

        # What the docs ask of a trainer that puts with NIXL itself, once: its
        # NIXL progress thread at idle priority (else it keeps a core busy, half
        # of this test box).
        from sglang.srt.ray.rdt import start_nixl_agent

        start_nixl_agent()
        self.bucket = torch.zeros(bucket_bytes, dtype=torch.uint8)
        register_nixl_memory(self.bucket)
        self.refs: List = []

    def stage_and_put(self, tensors: Dict[str, torch.Tensor]):
        """Pack ``tensors`` (in order) into the bucket; put views of it."""
        views, off = [], 0
        for t in tensors.values():
            t = t.contiguous()
            n = t.numel() * t.element_size()
            off = -(-off // t.element_size()) * t.element_size()  # dtype alignment
            view = self.bucket[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            views.append(view)
            off += n
        assert off <= self.bucket.numel(), "bucket too small for the round"
        ref = ray.put(views, _tensor_transport="nixl")
        self.refs = [ref]  # the previous round's ref is dropped
        return [ref]

    def actor_id(self) -> str:
        return ray.get_runtime_context().get_actor_id()
