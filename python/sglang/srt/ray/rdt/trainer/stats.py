"""What an update did, as :meth:`WeightSyncClient.update` returns it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from sglang.srt.ray.rdt.trainer.buckets import describe_bytes


@dataclass
class BucketStats:
    """One step of an update: group ``index`` of every rank group."""

    index: int
    tensors: int
    bytes: int
    ranks: int
    fill_seconds: float  # copy into a slot (buckets) or describe in place (direct)
    pull_seconds: float  # the slowest rank's own pull time (plan + transfer)
    gbps: float  # bytes / pull_seconds
    rank_seconds: List[float] = field(default_factory=list)
    # perf_counter times (one clock per host); rank_timing: the slowest rank's pull_start/end, copy/plan_seconds, ended.
    sent_at: float = 0.0
    received_at: float = 0.0
    rank_timing: Dict[str, float] = field(default_factory=dict)


@dataclass
class UpdateStats:
    """What :meth:`WeightSyncClient.update` did.

    ``bytes``: the payload, once per rank group; ``bytes_moved``: every rank's copy. ``seconds``: the whole call;
    ``transfer_seconds``: first fill to last pull's return; ``gbps`` = ``bytes / transfer_seconds``. ``path``:
    ``"direct"`` (ranks read the trainer's tensors), ``"write"`` (the trainer wrote them into the ranks' parameters,
    one copy), ``"buckets"`` (gathered into the slots), or such names joined by ``+``. ``gathered_bytes``: what was
    gathered; ``held_bytes``: the most trainer bytes in flight at once (``client.pool_bytes()``: what the staging
    pool holds).
    """

    version: Optional[str]
    tensors: int
    bytes: int
    bytes_moved: int
    ranks: int
    buckets: List[BucketStats]
    seconds: float
    transfer_seconds: float
    begin_seconds: float
    end_seconds: float
    gbps: float
    path: str = "buckets"
    transport: str = "none"  # the path(s) the ranks' pulls took, comma-separated
    lane_calls: int = 0  # pulls sent over a rank's same-node lane, not through Ray
    held_bytes: int = 0
    gathered_bytes: int = 0
    plan_seconds: float = 0.0  # a mapping: planned and checked whole before anything moved

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.tensors} tensors, {describe_bytes(self.bytes)} to {self.ranks} "
                f"rank{'s' if self.ranks != 1 else ''} in {len(self.buckets)} step"
                f"{'s' if len(self.buckets) != 1 else ''} ({self.path}): transfer "
                f"{self.transfer_seconds:.3f} s ({self.gbps:.3f} GB/s), update {self.seconds:.3f} s, "
                f"transport={self.transport}, weight_version={self.version}"
                + (f", gathered {describe_bytes(self.gathered_bytes)}" if self.gathered_bytes else ""))
