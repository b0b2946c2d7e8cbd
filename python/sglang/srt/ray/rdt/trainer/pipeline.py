"""The double-buffered bucket pipeline of one update.

Bucket k+1 is filled into the sender's other slot while every rank pulls
bucket k; a slot is written again only after every rank's pull of it
returned (the sender refuses otherwise). After a failure, pulls still
reading are waited for (bounded); a slot whose pulls never return stays
reserved (:meth:`BucketPipeline.reclaim_stuck` frees it once they do).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from sglang.srt.ray.rdt.defaults import NUM_SLOTS
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer.buckets import Step
from sglang.srt.ray.rdt.ranks import settle, unfinished
from sglang.srt.ray.rdt.trainer.discovery import RankInfo
from sglang.srt.ray.rdt.trainer.lane import LaneCall, Lanes
from sglang.srt.ray.rdt.trainer.stats import BucketStats

logger = logging.getLogger(__name__)

Progress = Callable[[BucketStats, int, int], None]


@dataclass
class Flight:
    """A filled bucket slot and the pulls reading it."""

    step: Step
    slot: int
    token: str
    refs: List[Any]
    fill_seconds: float
    pulls: List[Tuple[int, Any]] = field(default_factory=list)  # (rank, ObjectRef or LaneCall)
    pulled: List[Any] = field(default_factory=list)  # the ref each of those pulls reads


@dataclass
class PipelineRun:
    """One update's pass through the pipeline (what the client reads after it)."""

    steps: List[Step]
    flights: Dict[int, Flight] = field(default_factory=dict)  # slot -> flight
    buckets: List[BucketStats] = field(default_factory=list)
    paths: List[str] = field(default_factory=list)  # transports the pulls took
    session_id: Optional[str] = None
    session_open: bool = False
    begin_seconds: float = 0.0
    transfer_seconds: float = 0.0
    lane_calls: int = 0  # pulls sent over a rank's same-node call lane


def prepare_pulls(ranks: Sequence[RankInfo], sends, gather, lanes: Lanes, phase: str,
                  timeout_s: float) -> int:
    """``prepare_pull_weights([ref], names)`` on every rank of each ``(ref,
    names, rank indices)`` of ``sends``, waited for together; the ranks then
    hold those refs (their lanes may name them). Returns how many calls."""
    calls = [(r, ref, ranks[r].actor.prepare_pull_weights.remote([ref], names))
             for ref, names, group in sends for r in group]
    gather([(r, call) for r, _, call in calls], phase, timeout_s)
    for r, ref, _ in calls:
        lanes.held(r, ref)
    return len(calls)


class BucketPipeline:
    def __init__(
        self,
        ranks: Sequence[RankInfo],
        sender_call: Callable[..., Any],
        gather: Callable[[Sequence[Tuple[int, Any]], str, float], Dict[int, Any]],
        lanes: Optional[Lanes] = None,
    ):
        self.ranks = ranks
        self.sender_call = sender_call
        self.gather = gather
        # A bucket ref a rank read before (the sender keeps them) is pulled
        # over the rank's same-node call lane (.lane).
        self.lanes = lanes or Lanes(enabled=False)
        self.stuck: Dict[int, Flight] = {}

    def run(
        self,
        steps: List[Step],
        payloads: Sequence[Mapping[str, Any]],
        groups: List[List[int]],
        *,
        pull_timeout: Optional[float],
        wait_s: float,
        open_session: Callable[[], Optional[str]],
        progress: Optional[Progress] = None,
        run: Optional[PipelineRun] = None,
    ) -> PipelineRun:
        """Send every step; the session opens after the first fill (serving
        pauses as late as possible). On failure ``run`` keeps what is in flight."""
        run = run or PipelineRun(steps)
        tag = uuid.uuid4().hex[:8]
        current = self._fill(run, steps[0], payloads, groups, tag)
        t0 = time.perf_counter()
        run.session_id = open_session()
        run.session_open = True
        t_transfer = time.perf_counter()
        run.begin_seconds = t_transfer - t0
        for i in range(len(steps)):
            self._launch(current, groups, pull_timeout)
            if i + 1 < len(steps):
                previous = run.flights.get((i + 1) % NUM_SLOTS)
                if previous is not None:
                    self._land(run, previous, wait_s, progress)  # its slot takes the next bucket
                current = self._fill(run, steps[i + 1], payloads, groups, tag)  # overlaps the pulls
        for flight in sorted(run.flights.values(), key=lambda f: f.step.index):
            self._land(run, flight, wait_s, progress)
        run.transfer_seconds = time.perf_counter() - t_transfer + run.buckets[0].fill_seconds
        run.buckets.sort(key=lambda b: b.index)
        return run

    def prime(self, steps: List[Step], groups, call_timeout_s: float) -> int:
        """Put every step's buckets as its fill will (the sender keeps the
        refs; nothing is copied) and have each rank prepare its pulls of them
        (``prepare_pull_weights``: checks, plan, same-node mappings; nothing
        written). The first update then costs what later ones do."""
        sends = []
        for step in steps:
            slot = step.index % NUM_SLOTS
            layout = [(region.offset,
                       [(s.name, s.offset, s.nbytes, s.shape, s.dtype) for s in region.bucket.slices])
                      for region in step.regions]
            (refs,) = self.sender_call("prime", slot, layout)
            sends += [(ref, region.bucket.names, groups[region.group])
                      for region, ref in zip(step.regions, refs)]
        return prepare_pulls(self.ranks, sends, self.gather, self.lanes,
                             "prepare_pull_weights of the buckets", call_timeout_s)

    def _fill(self, run: PipelineRun, step: Step, payloads, groups, tag: str) -> Flight:
        slot = step.index % NUM_SLOTS
        if slot in run.flights:  # never: the loop lands a slot before refilling it
            raise WeightSyncError(f"internal error: bucket slot {slot} is still in flight")
        regions = [
            (region.offset,
             [(s.name, s.offset, s.nbytes, s.shape, s.dtype) for s in region.bucket.slices],
             [payloads[groups[region.group][0]][s.name] for s in region.bucket.slices])
            for region in step.regions
        ]
        t0 = time.perf_counter()
        flight = Flight(step, slot, f"update {tag} bucket {step.index}", [], 0.0)
        run.flights[slot] = flight  # in flight from here on: fill marks it first
        (refs,) = self.sender_call("fill", slot, flight.token, regions)
        flight.refs, flight.fill_seconds = refs, time.perf_counter() - t0
        return flight

    def _launch(self, flight: Flight, groups, pull_timeout: Optional[float]) -> None:
        for region, ref in zip(flight.step.regions, flight.refs):
            names = region.bucket.names
            for r in groups[region.group]:
                flight.pulls.append((r, self.lanes.pull(self.ranks[r], ref, names, pull_timeout, {})))
                flight.pulled.append(ref)

    def _land(self, run: PipelineRun, flight: Flight, wait_s: float,
              progress: Optional[Progress]) -> None:
        phase = f"pull of bucket {flight.step.index + 1}/{len(run.steps)}"
        results = self.gather(flight.pulls, phase, wait_s)
        # Every rank's pull of this slot returned: it may be written again.
        self.sender_call("release", flight.slot, flight.token)
        del run.flights[flight.slot]
        for (r, call), ref in zip(flight.pulls, flight.pulled):
            self.lanes.held(r, ref)
            run.lane_calls += isinstance(call, LaneCall)
        rank_seconds = [float(results[r].get("seconds", 0.0)) for r, _ in flight.pulls]
        for r, _ in flight.pulls:
            for t in str(results[r].get("transport") or "").split(","):
                if t and t not in run.paths:
                    run.paths.append(t)
        slowest = max(rank_seconds, default=0.0)
        stats = BucketStats(
            index=flight.step.index, tensors=flight.step.tensors, bytes=flight.step.nbytes,
            ranks=len(flight.pulls), fill_seconds=flight.fill_seconds, pull_seconds=slowest,
            gbps=flight.step.nbytes / slowest / 1e9 if slowest > 0 else 0.0,
            rank_seconds=rank_seconds,
        )
        run.buckets.append(stats)
        if progress is not None:
            try:
                progress(stats, len(run.buckets), len(run.steps))
            except Exception as e:  # a display bug must not abort an update
                logger.warning("[RDT] progress callback failed: %s", e)

    # -- after a failure ------------------------------------------------------ #
    def settle(self, run: PipelineRun, wait_s: float) -> None:
        """Wait (bounded) for pulls still reading; free their slots."""
        for slot, flight in list(run.flights.items()):
            settle(flight.pulls, wait_s)
            not_ready = unfinished(flight.pulls)
            if not_ready:
                logger.error(
                    "[RDT] %d pull(s) of bucket slot %d did not return; the slot stays "
                    "reserved until they do", len(not_ready), slot,
                )
                self.stuck[slot] = flight
                continue
            try:
                self.sender_call("release", slot, flight.token)
            except WeightSyncError as e:  # e.g. the fill itself failed before marking
                logger.debug("[RDT] release of slot %d after failure: %s", slot, e)

    def reclaim_stuck(self) -> None:
        """Free slots a failed update left in flight, once their pulls are over."""
        for slot, flight in list(self.stuck.items()):
            settle(flight.pulls, 1.0)
            not_ready = unfinished(flight.pulls)
            if not_ready:
                raise WeightSyncError(
                    f"a pull of a previous, failed update still reads bucket slot {slot} "
                    f"({len(not_ready)} rank(s) have not returned); wait for them or "
                    "restart the ranks before the next update"
                )
            self.sender_call("release", slot, flight.token)
            del self.stuck[slot]
