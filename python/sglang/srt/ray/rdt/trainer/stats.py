"""What an update did, as :meth:`WeightSyncClient.update` returns it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from sglang.srt.ray.rdt.trainer.buckets import describe_bytes


@dataclass
class BucketStats:
    """One bucket (one step: bucket k of every rank group) of an update."""

    index: int
    tensors: int
    bytes: int
    ranks: int
    fill_seconds: float
    pull_seconds: float  # slowest rank's own pull time (plan + transfer)
    gbps: float  # bytes / pull_seconds
    rank_seconds: List[float] = field(default_factory=list)


@dataclass
class UpdateStats:
    """What :meth:`WeightSyncClient.update` did.

    ``bytes`` is the payload (what the trainer sent, once per distinct rank
    group); ``bytes_moved`` counts every rank's copy. ``seconds`` is the whole
    call; ``transfer_seconds`` from the first bucket fill to the last pull's
    return; ``gbps`` = ``bytes`` / ``transfer_seconds``.
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
    transport: str = "nixl"  # the path(s) the ranks' pulls took, comma-separated
    lane_calls: int = 0  # pulls that went over a rank's same-node call lane, not Ray

    @classmethod
    def of(cls, run, steps, groups, version, ranks: int, seconds: float,
           end_seconds: float) -> "UpdateStats":
        """The figures of a finished :class:`~.pipeline.PipelineRun`."""
        if steps:
            nbytes = sum(s.nbytes for s in steps)
            moved = sum(r.bucket.nbytes * len(groups[r.group]) for s in steps for r in s.regions)
        else:  # zero-copy: one "bucket" per rank group
            nbytes = sum(b.bytes for b in run.buckets)
            moved = sum(b.bytes * b.ranks for b in run.buckets)
        return cls(
            version=version, tensors=sum(b.tensors for b in run.buckets), bytes=nbytes,
            bytes_moved=moved, ranks=ranks, buckets=run.buckets, seconds=seconds,
            transfer_seconds=run.transfer_seconds, begin_seconds=run.begin_seconds,
            end_seconds=end_seconds,
            gbps=nbytes / run.transfer_seconds / 1e9 if run.transfer_seconds > 0 else 0.0,
            transport=",".join(run.paths) or "none",
            lane_calls=run.lane_calls,
        )

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"{self.tensors} tensors, {describe_bytes(self.bytes)} to {self.ranks} "
            f"rank{'s' if self.ranks != 1 else ''} in {len(self.buckets)} bucket"
            f"{'s' if len(self.buckets) != 1 else ''}: transfer {self.transfer_seconds:.3f} s "
            f"({self.gbps:.3f} GB/s), update {self.seconds:.3f} s, "
            f"transport={self.transport}, weight_version={self.version}"
        )
