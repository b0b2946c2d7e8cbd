"""One :meth:`WeightSyncClient.update`: plan, transfer, finish (docs/architecture.md, "The trainer path").

A slot is refilled only after every rank's pull of it returned; an iterator read in place has at most two buckets'
worth alive. On any failure the pulls still reading are waited for (bounded) before the session is aborted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from sglang.srt.ray.rdt.defaults import PULL_TIMEOUT_S, PULL_WAIT_MARGIN_S, STREAM_GROUPS_PER_BUCKET
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError
from sglang.srt.ray.rdt.ranks import settle, unfinished
from sglang.srt.ray.rdt.trainer import buckets
from sglang.srt.ray.rdt.trainer.lane import LaneCall
from sglang.srt.ray.rdt.trainer.sender import write_into
from sglang.srt.ray.rdt.trainer.stats import BucketStats, UpdateStats
from sglang.srt.ray.rdt.transport import same_node
from sglang.srt.ray.rdt.transport.metadata import MappingFailed

logger = logging.getLogger(__name__)


@dataclass
class Flight:
    """A step sent to its ranks, and what it holds until they all answered."""

    index: int
    step: List[Tuple[int, buckets.Group]]
    calls: List[Tuple[int, Any]]  # (rank, ObjectRef or LaneCall)
    fill_seconds: float
    sent_at: float = 0.0
    slot: Optional[int] = None  # buckets: the slot the ranks read
    token: str = ""
    held_bytes: int = 0  # direct: the trainer's bytes the ranks read in place
    sources: List[Tuple[Any, Any]] = field(default_factory=list)  # per region: (ref, description)
    writes: List[tuple] = field(default_factory=list)  # queued here, not yet confirmed: (rank, group, grant, outcome)


class _Replan(Exception):
    """A rank cannot be written from here; nothing moved: the mapping is planned again without writes."""


@dataclass
class Update:
    client: Any
    version: Optional[str]
    bucket_bytes: int
    strict: bool
    flush_cache: bool
    progress: Any = None
    flights: deque = field(default_factory=deque)
    steps_done: List[BucketStats] = field(default_factory=list)
    paths: List[str] = field(default_factory=list)
    session_id: Optional[str] = None
    session_open: bool = False
    begin_seconds: float = 0.0
    end_seconds: float = 0.0
    lane_calls: int = 0
    held: int = 0
    max_held: int = 0
    gathered: int = 0  # bytes gathered into the slots (not read where the trainer made them)
    written: int = 0  # bytes this process wrote into the ranks' parameters itself
    in_place: bool = False  # a mapping: read where it is (every tensor in kept memory)
    push: bool = False  # else: written by this process straight into the ranks' parameters (their device is ours)
    ended: bool = False  # the session's end was called
    moved_bytes: int = 0
    t_first: Optional[float] = None
    # set by plan(): the client's route, the rank groups, what each was sent
    route: Any = None
    rank_groups: List[List[int]] = field(default_factory=list)
    sent: List[set] = field(default_factory=list)
    stream: bool = False
    slot_bytes: int = 0
    group_bytes: int = 0
    wait_s: float = 0.0
    total: Optional[int] = None  # steps of a mapping (an iterator's: unknown)
    plan_seconds: float = 0.0  # a mapping: split, cut, looked at and checked whole

    def run(self, named) -> UpdateStats:
        t0 = time.perf_counter()
        self._tag = next(self.client.update_tags)
        steps = self.plan(named)
        if not self.stream:
            self.plan_seconds = time.perf_counter() - t0
        try:
            try:
                self._transfer(iter(steps))
            except _Replan:
                self._transfer(iter(self.plan(named)))
            if not self.ended:
                self._finish()
        except BaseException as e:
            still = self._settle()
            if still:
                e.add_note(still)
            if self.session_open:
                self._abort(e)
            raise
        return self._stats(t0)

    def plan(self, named):
        """The steps of ``named``: an iterator's, made as they are sent; a mapping's, listed with every layout
        checked before anything moves (:meth:`WeightSyncClient.register` prepares them)."""
        c = self.client
        self.route = c.route()
        self.wait_s = (c.pull_timeout_s or PULL_TIMEOUT_S) + PULL_WAIT_MARGIN_S
        self.stream = buckets.is_stream(named)
        payloads, self.rank_groups = buckets.split_payloads(named, len(c.ranks))
        self.sent = [set() for _ in self.rank_groups]
        if not self.stream:  # (each mapping looked at once)
            payloads = [buckets.whole(p) for p in payloads]
            self.in_place = self.route.direct and all(readable_in_place(p, c.device_obj) for p in payloads)
        # what ranks cannot read in place, this process writes into them when they are on its own device
        self.push = not self.in_place and c.export != "buckets" and all(
            getattr(c.lanes.link(r), "writable", False) for rg in self.rank_groups for r in rg)
        self.group_bytes = group_bytes_for(self.in_place or (self.stream and self.route.direct) or self.push,
                                           self.bucket_bytes, self.stream)
        steps = buckets.steps(payloads, self.rank_groups, self.group_bytes)
        self.slot_bytes = self.bucket_bytes
        if self.stream:
            return steps
        planned = [self._check(step) for step in steps]
        if not self.in_place:
            self.slot_bytes = max(buckets.slot_layout(step)[1] for step in planned)
        if self.strict:
            for rg, payload in enumerate(payloads):
                for r in self.rank_groups[rg]:
                    buckets.check_strict(payload.names, c.parameter_layouts()[r], c.labels[r])
        self.total = len(planned)
        return planned

    def _check(self, step):
        c = self.client
        for rg, group in step:
            c.layouts_book.assign(rg, group, self.rank_groups[rg], c.parameter_layouts(), c.labels)
        return step

    def _transfer(self, steps) -> None:
        while True:
            while self.flights and not self._room():
                self._land(self.flights.popleft())
            step = next(steps, None)  # (an iterator's tensors are made now, where its code makes them)
            if step is None:
                break
            if self.stream:
                self._check(step)
            self._send(step)
        while self.flights:
            self._land(self.flights.popleft())

    def _room(self) -> bool:
        """Whether the next step may be sent before another lands: in place, always; gathered, while a slot is
        free; an iterator, while its bytes in flight and the next group stay within two buckets."""
        if self.in_place:
            return True
        if not self.stream:
            return len(self.flights) < 2
        return self.held + self.group_bytes <= 2 * self.bucket_bytes

    def _send(self, step) -> None:
        """Make ``step`` readable and ask its ranks to pull it (in flight from here on)."""
        c = self.client
        index = len(self.steps_done) + len(self.flights)
        if self.t_first is None:
            self.t_first = time.perf_counter()
        t0 = time.perf_counter()
        if self.in_place or (self.stream and self.route.direct and all(
                readable_in_place(g, c.device_obj) for _, g in step)):
            flight = self._describe(index, step)
        else:
            flight = (self.push and self._push(index, step)) or self._fill(index, step)
        self.flights.append(flight)
        flight.fill_seconds = time.perf_counter() - t0
        self._begin()
        flight.sent_at = time.perf_counter()
        for (rg, group), (ref, meta) in zip(step, flight.sources):
            for r in self.rank_groups[rg]:
                try:
                    if r in self.route.lanes:
                        call = c.lanes.pull(r, group, meta, c.pull_timeout_s)
                        self.lane_calls += 1
                    else:
                        call = c.ranks[r].actor.pull_weights.remote([ref], group.names, c.pull_timeout_s)
                except Exception as e:  # (the pulls already sent are settled: the flight holds them)
                    raise WeightSyncRankError(r, c.ranks[r].name, f"pull of step {index + 1}", e, [(r, e)]) from e
                flight.calls.append((r, call))
            if self.stream and self.strict:  # (a mapping was checked whole before)
                self.sent[rg].update(group.names)

    def _begin(self) -> None:
        if not self.session_open:
            t0 = time.perf_counter()
            self.session_id = self.client.session.begin()
            self.session_open = True
            self.begin_seconds = time.perf_counter() - t0

    def _push(self, index: int, step) -> Optional[Flight]:
        """Write the step straight into its ranks' parameters (one copy): each rank grants its targets after the checks
        of a pull, this process queues its writes, the step lands once they are done and confirmed (:meth:`_confirm`).
        None: a rank cannot be written from here (nothing written; the slots take over)."""
        c = self.client
        self._begin()
        grants = [(r, g, c.lanes.pull(r, g, None, c.pull_timeout_s, op="grant"))
                  for rg, g in step for r in self.rank_groups[rg]]
        flight, error = Flight(index, step, [], 0.0), None
        self.lane_calls += 2 * len(grants)  # (each answered by a "pushed")
        for r, g, call in grants:
            try:
                out = call.result(self.wait_s)
                c.lanes.defined(r, call)
            except Exception as e:  # (every grant is answered before anything is written)
                error = error or (r, e, "pull")
                continue
            outcome = "none"
            try:
                if error is None:
                    outcome = "broken"
                    write_into(out["targets"], g, c.device_obj)
                    outcome = "done"
            except MappingFailed as e:
                outcome, error = "none", error or (r, e, "write")
            except BaseException as e:
                error = error or (r, e, "write")
            flight.writes.append((r, g, out["grant"], outcome))
        if error is None:
            flight.held_bytes = sum(g.nbytes for _, g in step)  # (read until the writes are done)
            self.held += flight.held_bytes
            self.max_held = max(self.max_held, self.held)
            self.written += flight.held_bytes
            return flight
        self._confirm(flight)
        settle(flight.calls, self.wait_s)  # (the ranks recorded every outcome before the slots take over)
        r, e, phase = error
        if not isinstance(e, MappingFailed):  # (refused before any byte moved: the slots take over)
            raise WeightSyncRankError(r, c.ranks[r].name, f"{phase} of step {index + 1}", e, [(r, e)]) from e
        logger.warning("[RDT] %s: its steps go through the bucket slots (%s)", c.labels[r], str(e)[:300])
        c.lanes.links[r].writable = self.push = False
        if not self.stream:
            raise _Replan()  # (a mapping's one step: cut again for the slots)
        return None

    def _confirm(self, flight: Flight) -> None:
        """Wait until the flight's queued writes are done, then tell each rank how its write went."""
        c, writes, flight.writes = self.client, flight.writes, []
        t0, done = time.perf_counter(), False
        try:
            torch.cuda.current_stream(c.device_obj).synchronize()
            done = True
        finally:
            for r, g, grant, outcome in writes:
                flight.calls.append((r, c.lanes.links[r].send("pushed", {
                    "grant": grant, "outcome": outcome if done or outcome != "done" else "broken",
                    "transport": "cuda_ipc write", "tensors": len(g.names), "bytes": g.nbytes,
                    "seconds": time.perf_counter() - t0})))

    def _describe(self, index: int, step) -> Flight:
        """Kept memory: describe the trainer's own tensors where they are."""
        device = self.client.device_obj
        if device.type == "cuda" and (self.stream or index == 0):
            # queued work on the tensors must be done before a rank reads them
            torch.cuda.synchronize(device)
        sources = [(None, same_node.export(g.tensors, with_specs=False, scan=g.scan)) for _, g in step]
        held = sum(g.nbytes for _, g in step)
        self.held += held
        self.max_held = max(self.max_held, self.held)
        return Flight(index, step, [], 0.0, held_bytes=held, sources=sources)

    def _fill(self, index: int, step) -> Flight:
        """Gather the step into a free slot (one batched copy); a ref of it for Ray ranks."""
        c = self.client
        offsets, need = buckets.slot_layout(step)
        if need > c.sender.slot_bytes:  # first use, or a stream's tensor larger than the slots
            while self.flights:
                self._land(self.flights.popleft())
            # a stream's slots: large enough for any step of these parameters, so none is made twice
            any_step = (c.slot_bytes_for_any_update(self.bucket_bytes) or 0) if self.stream else 0
            c.sender.prepare(max(need, self.slot_bytes, any_step), c.ranks)
        while len([f for f in self.flights if f.slot is not None]) >= 2:
            self._land(self.flights.popleft())  # (a stream: both slots in flight)
        slot, token = min({0, 1} - {f.slot for f in self.flights}), f"update {self._tag} step {index}"
        flight = Flight(index, step, [], 0.0, slot=slot, token=token)
        local = any(r in self.route.lanes for rg, _ in step for r in self.rank_groups[rg])
        ray_ranks = any(r not in self.route.lanes for rg, _ in step for r in self.rank_groups[rg])
        flight.sources = c.sender.call("fill", slot, token, offsets, [g for _, g in step],
                                       self.route.ref_transport if ray_ranks else None, local)
        self.gathered += need
        for _, group in step:
            group.tensors = []  # copied: the trainer's tensors are not read again
        return flight

    def _land(self, flight: Flight) -> None:
        c = self.client
        try:
            if flight.writes:
                self._confirm(flight)
            results = c.gather(flight.calls, f"pull of step {flight.index + 1}", self.wait_s)
            received_at = time.perf_counter()
        except BaseException:
            self.flights.appendleft(flight)  # settled (and its slot freed) with the others
            raise
        for r, call in flight.calls:
            if isinstance(call, LaneCall):
                c.lanes.defined(r, call)
            for t in str(results[r].get("transport") or "").split(","):
                if t and t not in self.paths:
                    self.paths.append(t)
        self.held -= flight.held_bytes
        nbytes = sum(g.nbytes for _, g in flight.step)
        self.moved_bytes += sum(g.nbytes * len(self.rank_groups[rg]) for rg, g in flight.step)
        rank_seconds = [float(results[r].get("seconds", 0.0)) for r, _ in flight.calls]
        slowest = max(rank_seconds, default=0.0)
        stats = BucketStats(index=flight.index, tensors=sum(len(g.names) for _, g in flight.step), bytes=nbytes,
                            ranks=len(flight.calls), fill_seconds=flight.fill_seconds, pull_seconds=slowest,
                            gbps=nbytes / slowest / 1e9 if slowest > 0 else 0.0,
                            rank_seconds=rank_seconds, sent_at=flight.sent_at, received_at=received_at)
        if flight.calls:
            res = results[max(flight.calls, key=lambda c: results[c[0]].get("seconds", 0.0))[0]]
            stats.rank_timing = {**(res.get("timing") or {}),
                                 "copy_seconds": sum(r.get("copy_seconds", 0.0) for r in res.get("reads", ())),
                                 "plan_seconds": res.get("plan_seconds", 0.0)}
        if flight.slot is not None:  # every rank read it: it may be filled again
            c.sender.call("release", flight.slot, flight.token)
        flight.step = []  # the trainer's tensors (direct) are let go here
        self.steps_done.append(stats)
        if self.progress is not None:
            try:
                self.progress(stats, len(self.steps_done), self.total)
            except Exception as e:  # a display bug must not abort an update
                logger.warning("[RDT] progress callback failed: %s", e)

    def _finish(self) -> None:
        c = self.client
        if self.stream and self.strict:
            for rg, names in enumerate(self.sent):
                for r in self.rank_groups[rg]:
                    buckets.check_strict(names, c.parameter_layouts()[r], c.labels[r])
        t0, self.ended = time.perf_counter(), True
        c.session.end(self.session_id, self.version, self.flush_cache)
        self.end_seconds = time.perf_counter() - t0

    def _settle(self) -> Optional[str]:
        """After a failure: wait (bounded) for pulls still reading and free the slots no pull
        reads (the others go to ``client.stuck``). Returns what may still read the trainer's memory, if anything."""
        c = self.client
        deadline = time.monotonic() + self.wait_s  # one bound for every flight
        still = []
        for flight in self.flights:
            if flight.writes:  # (its memory is read until the writes are done)
                try:
                    self._confirm(flight)
                except Exception as e:
                    logger.error("[RDT] the writes of step %d did not complete: %s", flight.index + 1, e)
            settle(flight.calls, max(0.0, deadline - time.monotonic()))
            if unfinished(flight.calls):
                still.append(flight.index + 1)
        for flight in self.flights:
            if flight.slot is None:
                continue
            if unfinished(flight.calls):
                logger.error("[RDT] pulls of bucket slot %d did not return; it stays reserved", flight.slot)
                c.stuck.append(flight)
                continue
            try:
                c.sender.call("release", flight.slot, flight.token)
            except WeightSyncError as e:  # e.g. the fill itself failed before marking
                logger.debug("[RDT] release of slot %d after failure: %s", flight.slot, e)
        self.flights.clear()
        if still:
            return (f"pulls of steps {still} did not end within {self.wait_s:.0f} s: those ranks "
                    "may still read this trainer's memory")
        return None

    def _abort(self, e: BaseException) -> None:
        """Abort the engine's session after ``e``; say on ``e`` if that failed too."""
        reason = f"weight-sync client: {type(e).__name__}: {str(e)[:300]}"
        try:
            self.client.session.abort(self.session_id, reason)
            if isinstance(e, WeightSyncRankError):
                e.aborted = True
        except Exception as abort_error:
            logger.error("[RDT] aborting the engine's update session failed: %s", abort_error)
            e.add_note(f"aborting the engine's update session failed too: {abort_error}")

    def _stats(self, t0: float) -> UpdateStats:
        transfer = time.perf_counter() - (self.t_first or t0) - self.end_seconds
        payload = sum(b.bytes for b in self.steps_done)
        return UpdateStats(
            version=self.version, tensors=sum(b.tensors for b in self.steps_done), bytes=payload,
            bytes_moved=self.moved_bytes, ranks=len(self.client.ranks), buckets=self.steps_done,
            seconds=time.perf_counter() - t0, transfer_seconds=transfer,
            begin_seconds=self.begin_seconds, end_seconds=self.end_seconds, plan_seconds=self.plan_seconds,
            gbps=payload / transfer / 1e9 if transfer > 0 else 0.0,
            path="+".join(p for p, n in (("direct", payload - self.gathered - self.written), ("write", self.written),
                                         ("buckets", self.gathered)) if n > 0) or "direct",
            transport=",".join(self.paths) or "none", lane_calls=self.lane_calls,
            held_bytes=self.max_held, gathered_bytes=self.gathered)


def readable_in_place(group: buckets.Group, device) -> bool:
    """Whether ranks may read ``group`` where it is: contiguous, on ``device``, and on a GPU in kept memory."""
    scan = group.scan
    index = device.index if device.type == "cuda" else -1
    if not (scan.contiguous.all() and (scan.device == index).all()):
        return False
    return device.type != "cuda" or bool(same_node.kept_mask(scan).all())


def group_bytes_for(read_in_place: bool, bucket_bytes: int, stream: bool) -> int:
    """Group size: gathered, a slot (``bucket_bytes``); in place, all of a mapping (one pull per rank) or half a
    bucket of an iterator (the next groups are made while the ranks copy)."""
    if not read_in_place:
        return bucket_bytes
    return max(bucket_bytes // STREAM_GROUPS_PER_BUCKET, 1) if stream else buckets.WHOLE
