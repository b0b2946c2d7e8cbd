"""The client's hold on its bucket sender: in this process or a Ray actor.

Owns the sender's life (created on first use, sized up when an update needs
bigger slots, closed with the client) and the one rule around its memory:
ranks keep CUDA IPC mappings of the sender's persistent slots between
updates, so before the slots are freed every rank is asked to release them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence

from sglang.srt.ray.rdt.defaults import NUM_SLOTS
from sglang.srt.ray.rdt.errors import WeightSyncError, describe, unwrap
from sglang.srt.ray.rdt.trainer.discovery import RankInfo
from sglang.srt.ray.rdt.trainer.sender import BucketSender, sender_actor_class

logger = logging.getLogger(__name__)


class SenderLink:
    def __init__(
        self,
        device: str,
        sender: Any,
        options: Optional[Dict[str, Any]],
        call_timeout_s: float,
        transport: Callable[[], str],
    ):
        self.device = device
        self.owned = sender is None or isinstance(sender, str)
        self.local = isinstance(sender, str)
        if self.local and sender != "local":
            raise ValueError(f"sender must be an actor handle or 'local', got {sender!r}")
        self.sender = None if isinstance(sender, str) else sender
        self.options = dict(options or {})
        self.call_timeout_s = call_timeout_s
        self.transport = transport  # resolves the put transport on first use
        self.slot_bytes = 0

    def handle(self):
        if self.sender is None and self.local:
            self.sender = BucketSender(self.device, NUM_SLOTS, transport=self.transport())
        if self.sender is None:
            options = {"num_cpus": 0, **self.options}
            if self.device.startswith("cuda"):
                options.setdefault("num_gpus", 1)
            self.sender = sender_actor_class().options(**options).remote(
                self.device, NUM_SLOTS, transport=self.transport()
            )
        return self.sender

    def call(self, method: str, *args):
        import ray

        sender = self.handle()
        try:
            if self.local:
                return getattr(sender, method)(*args)
            return ray.get(getattr(sender, method).remote(*args), timeout=self.call_timeout_s)
        except Exception as e:
            cause = unwrap(e)
            raise WeightSyncError(
                f"the bucket sender failed in {method}: {describe(cause)}"
            ) from cause

    def prepare(self, slot_bytes: int, ranks: Sequence[RankInfo]) -> None:
        """Slots of at least ``slot_bytes`` (allocated, registered) before an update."""
        if slot_bytes > self.slot_bytes:
            if self.slot_bytes:
                self.release_rank_mappings(ranks)  # the old slots are about to be freed
            self.slot_bytes = self.call("prepare", slot_bytes)["slot_bytes"]

    def release_rank_mappings(self, ranks: Sequence[RankInfo]) -> None:
        """Make every rank close its cached CUDA IPC mappings of the sender's
        slots before they are freed. Best effort per rank."""
        if not self.device.startswith("cuda") or self.sender is None:
            return
        try:
            token = self.call("ipc_sender_token")
        except Exception as e:
            logger.debug("[RDT] sender has no IPC identity: %s", e)
            return
        if token is None:
            return
        release_rank_mappings(ranks, token, self.call_timeout_s, "the buckets")

    def close(self, ranks: Sequence[RankInfo]) -> None:
        """Free the slots (NIXL deregistration) and the sender actor, if owned."""
        import ray

        if self.sender is None:
            return
        if self.owned:
            try:
                self.release_rank_mappings(ranks)
                self.call("close")
            finally:
                if not self.local:
                    ray.kill(self.sender)
        self.sender = None
        self.slot_bytes = 0


def release_rank_mappings(ranks: Sequence[RankInfo], token: str, timeout_s: float, what: str) -> None:
    """Every rank closes its CUDA IPC mappings of sender ``token``'s memory
    (before that memory is freed). Best effort per rank: a rank that does not
    answer is logged, the others still release."""
    import ray

    calls = [(r, r.actor.release_weight_sync_mappings.remote(token)) for r in ranks]
    for r, ref in calls:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as e:
            logger.warning("[RDT] %s did not release its mappings of %s: %s",
                           r.label(), what, describe(unwrap(e)))
