"""The weight-update state of one rank (:class:`RankUpdateState`): the single owner of everything an update is.

A second writer of a parameter in one update is refused before any byte of its pull lands and the update is marked
conflicting (a retry by the same writer is allowed and counted). A pull that broke mid-transfer leaves the rank
inconsistent until an update ends in which every parameter of that pull was written again and no conflict happened.
Mutating calls run on the scheduler thread; the lock makes the status readable from other threads."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang.srt.ray.rdt.engine import metrics as rdt_metrics
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightUpdateConflictError

logger = logging.getLogger(__name__)

MAX_LISTED_NAMES = 20  # how many never-written parameter names a summary lists


@dataclass(frozen=True)
class Writer:
    """Who put an RDT object: ``id`` is stable per process, ``label`` for humans."""

    id: str
    label: str


@dataclass
class _Update:
    """The update in progress on this rank."""

    kind: str  # "session": begin_weight_update opened it; "paused": a pull under a pause
    started: float
    pulls: int = 0
    tensors: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    pull_s: float = 0.0
    transports: List[str] = field(default_factory=list)
    writers: Dict[str, Writer] = field(default_factory=dict)  # param name -> writer
    # the last landed pull's (names, writer), folded into writers lazily: a one-pull update never builds it
    pending: Optional[Tuple[Sequence[str], Writer]] = None
    writer_ids: set = field(default_factory=set)  # every writer that landed a pull
    last_writer: tuple = ()  # (the writer of the last landed pull,)
    rewrites: int = 0
    conflict: Optional[str] = None
    broken: set = field(default_factory=set)  # params of a broken pull not written again
    failed_pulls: int = 0
    granted: Dict[int, Tuple[Sequence[str], Writer]] = field(default_factory=dict)  # writes not yet confirmed

    @property
    def touched(self) -> bool:
        return bool(self.writers or self.pending or self.broken or self.failed_pulls or self.granted)

    def written(self) -> Dict[str, Writer]:
        """Every parameter written in this update, and by whom."""
        if self.pending is not None:
            (names, writer), self.pending = self.pending, None
            before = len(self.writers)
            self.writers.update(dict.fromkeys(names, writer))
            self.rewrites += len(names) - (len(self.writers) - before)
        return self.writers

    def written_count(self) -> int:
        if self.pending is not None and not self.writers:
            return len(self.pending[0])  # (one pull's names are distinct: plan_pull refuses repeats)
        return len(self.written())


class RankUpdateState:
    """One rank's update state. ``param_names()``: its parameter names (for "N of M updated"), ``None`` if unknown;
    ``rank``: a log label (``"dp0/pp0/tp1"``); ``weight_version()``: sglang's; ``clock``: monotonic seconds."""

    def __init__(self, *, param_names: Optional[Callable[[], Sequence[str]]] = None, rank: str = "",
                 weight_version: Optional[Callable[[], Optional[str]]] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._param_names = param_names
        self.rank = rank
        self._weight_version = weight_version or (lambda: None)
        self._clock = clock
        self._lock = threading.RLock()  # guards the update, consistency and counters; taken last
        self._update: Optional[_Update] = None
        self._grants = 0
        self._consistent = True
        self._reason: Optional[str] = None
        self.updates = 0
        self.failed_updates = 0  # ended with a problem, or aborted
        self.failures: Dict[str, int] = {}
        self.last_update: Optional[Dict[str, Any]] = None
        self.totals: Dict[str, Any] = {"pulls": 0, "failed_pulls": 0, "tensors": 0, "bytes": 0,
                                       "seconds": 0.0, "last_pull": None}

    @property
    def update_open(self) -> bool:
        return self._update is not None

    @property
    def update_kind(self) -> Optional[str]:
        return getattr(self._update, "kind", None)

    @property
    def wrote_weights(self) -> bool:
        """Whether the update in progress wrote (or may have written) weights."""
        u = self._update
        return u is not None and u.touched

    def begin(self) -> None:
        """sglang's ``begin_weight_update``; pulls made before under a plain pause join the session."""
        with self._lock:
            if self._update is not None and self._update.kind == "paused":
                self._update.kind = "session"
                return
            self._update = _Update(kind="session", started=self._clock())

    def _current(self) -> _Update:
        if self._update is None:  # a pull under a plain pause opens an update
            self._update = _Update(kind="paused", started=self._clock())
        return self._update

    def admit(self, writes: Sequence[Tuple[Sequence[str], Writer]]) -> None:
        """Before any byte moves: :class:`WeightUpdateConflictError` if another writer wrote a name in ``writes``."""
        with self._lock:
            u = self._current()
            for names, writer in writes:
                if u.writer_ids <= {writer.id}:
                    continue  # nobody else wrote in this update: no conflict possible
                written = {**u.written(), **{n: w for ns, w in u.granted.values() for n in ns}}
                for name in names:
                    prev = written.get(name)
                    if prev is not None and prev.id != writer.id:
                        self._conflict(u, name, prev, writer)

    def _conflict(self, u: _Update, name: str, prev: Writer, writer: Writer) -> None:
        message = (f"parameter {name!r} was already written in this update by {prev.label}; refusing the pull from "
                   f"{writer.label}. Two writers must not write the same parameter in one update (a restarted "
                   "trainer whose old process still runs, or two jobs pointed at one engine?). Nothing of this pull "
                   "was written; the update is marked inconsistent: end or abort it, then run a clean update from "
                   "one trainer")
        u.conflict = u.conflict or message
        self._mark_inconsistent(message)
        self.fail("conflict")
        logger.error("[RDT]%s %s", f" {self.rank}" if self.rank else "", message)
        raise WeightUpdateConflictError(message)

    def landed(self, writes: Sequence[Tuple[Sequence[str], Writer]], stats: Dict[str, Any]) -> None:
        """A pull completed: each ``(names, writer)`` landed (``stats``: its figures)."""
        with self._lock:
            u = self._current()
            for names, writer in writes:
                u.written()  # (the pull before, if any)
                u.pending = (names, writer)
                u.writer_ids.add(writer.id)
                u.last_writer = (writer,)
                if u.broken:
                    u.broken.difference_update(names)
            u.pulls += 1
            u.tensors += int(stats.get("tensors", 0))
            u.bytes += int(stats.get("bytes", 0))
            u.transfer_s += float(stats.get("fetch_seconds") or stats.get("seconds") or 0.0)
            u.pull_s += float(stats.get("seconds") or 0.0)
            for t in stats.get("transports") or ():
                if t not in u.transports:
                    u.transports.append(t)
            t = self.totals
            t["pulls"] += 1
            t["tensors"] += int(stats.get("tensors", 0))
            t["bytes"] += int(stats.get("bytes", 0))
            t["seconds"] += float(stats.get("seconds") or 0.0)
            t["last_pull"] = dict(stats)
        rdt_metrics.record_pull(stats)

    def granted(self, names: Sequence[str], writer: Writer) -> int:
        """After :meth:`admit`: ``writer`` may write ``names`` itself, half-written until :meth:`confirmed`; its id."""
        with self._lock:
            self._grants += 1
            u = self._current()
            u.granted[self._grants] = (list(names), writer)
            u.writer_ids.add(writer.id)
            return self._grants

    def confirmed(self, grant: int, writer: Writer, outcome: str, stats: Dict[str, Any]) -> None:
        """``writer`` says how its write of ``grant`` went: ``"done"``, ``"none"`` (no byte written) or
        ``"broken"``. A grant this update does not hold (it ended) is a write nobody may trust."""
        with self._lock:
            u = self._update
            names, owner = u.granted.get(grant, ((), None)) if u is not None else ((), None)
            if owner is None or owner.id != writer.id:
                if outcome != "none":
                    reason = (f"{writer.label} reported a direct write {outcome} that no open update granted it "
                              "(the update ended or was aborted meanwhile): parameters may hold bytes of it")
                    self._mark_inconsistent(reason)
                    self.fail("transfer")
                    raise WeightsInconsistentError(reason)
                return
            del u.granted[grant]
            if outcome == "done":
                self.landed([(names, writer)], stats)
            elif outcome == "broken":
                self.transfer_failed(names, f"a direct write by {writer.label} broke mid-way")

    def transfer_failed(self, names: Sequence[str], reason: str) -> None:
        """A pull broke after bytes may have landed in ``names``."""
        with self._lock:
            u = self._current()
            u.failed_pulls += 1
            u.broken.update(names)
            written = u.written()
            for name in names:  # whoever wrote them before, their bytes are gone
                written.pop(name, None)
            self.totals["failed_pulls"] += 1
            self._mark_inconsistent(reason)
            self.fail("transfer")

    def end(self, **extra: Any) -> Dict[str, Any]:
        """The update ends. Returns its summary: the log line's figures and ``consistent``."""
        with self._lock:
            u = self._update or _Update(kind="session", started=self._clock())
            self._update = None
            names = self._names()
            problem = u.conflict
            if problem is None and u.granted:
                problem = (f"{sum(len(ns) for ns, _ in u.granted.values())} parameters granted for a direct write "
                           "were never confirmed written")
            if problem is None and u.broken:
                problem = (f"{len(u.broken)} parameters of a transfer that broke in this update "
                           f"were not written again (e.g. {sorted(u.broken)[0]!r})")
            self._consistent, self._reason = problem is None, problem
            # (one writer landed everything, no pull broke: it wrote every name of u.writers)
            whom = u.written().values() if len(u.writer_ids) > 1 or u.failed_pulls else u.last_writer
            writers = sorted({w.label for w in whom})
            count = u.written_count()
            summary = {
                "weight_version": self._weight_version(), "pulls": u.pulls, "tensors": u.tensors, "bytes": u.bytes,
                "transfer_seconds": u.transfer_s, "pull_seconds": u.pull_s,
                "gbps": u.bytes / u.transfer_s / 1e9 if u.transfer_s > 0 else 0.0,
                "transport": ",".join(u.transports) or "none", "update_seconds": self._clock() - u.started,
                "params_updated": count, "params_total": None if names is None else len(names),
                "writers": len(writers), "writer_labels": writers, "rewrites": u.rewrites, "conflict": u.conflict,
                "consistent": self._consistent, "inconsistent_reason": self._reason, **extra,
            }
            if names is not None:  # (every name written: the writers hold as many names)
                never = [] if count == len(names) else [n for n in names if n not in u.written()]
                summary["never_written"] = never[:MAX_LISTED_NAMES]
                summary["never_written_count"] = len(never)
            self.updates += 1
            if problem is not None:
                self.failed_updates += 1
            self.last_update = summary
        if problem is None:
            rdt_metrics.record_update(summary["update_seconds"], summary.get("adapters"))
            logger.info(format_update(summary, self.rank))
        else:
            logger.error("%s; weights inconsistent: %s", format_update(summary, self.rank), problem)
        return summary

    def writer_gone(self, writer_id: str, reason: str) -> Optional[str]:
        """A writer of the open update went away: mark the weights inconsistent; the update's kind, or None."""
        with self._lock:
            u = self._update
            if u is None or writer_id not in u.writer_ids:
                return None
            self._mark_inconsistent(reason)
            return u.kind

    def written_names(self, broken: bool = False) -> List[str]:
        """The parameters the open update wrote so far (``broken``: and those a broken pull may have written)."""
        with self._lock:
            u = self._update
            return [] if u is None else list(u.written()) + (sorted(u.broken) if broken else [])

    def interrupted(self, reason: str) -> bool:
        """Generation saw the update in progress: if it wrote weights, mark them inconsistent."""
        with self._lock:
            if self._update is None or not self._update.touched:
                return False
            self._mark_inconsistent(reason)
            return True

    def abort(self, reason: str) -> Dict[str, Any]:
        """Close the update without ending it; weights it touched are inconsistent."""
        with self._lock:
            u, self._update = self._update, None
            self.failed_updates += 1
            if u is not None and u.touched:
                self._mark_inconsistent(reason)
        self.fail("abort")
        return self.status()

    @property
    def consistent(self) -> bool:
        return self._consistent

    def in_progress(self) -> Optional[Dict[str, Any]]:
        with self._lock:
            u = self._update
            if u is None:
                return None
            return {"kind": u.kind, "pulls": u.pulls, "tensors": u.tensors, "bytes": u.bytes,
                    "params_written": u.written_count(), "writers": len({w.id for w in u.written().values()}),
                    "rewrites": u.rewrites, "conflict": u.conflict}

    def status(self) -> Dict[str, Any]:
        with self._lock:
            return {"weights_consistent": self._consistent, "inconsistent_reason": self._reason,
                    "weight_version": self._weight_version(), "update_open": self._update is not None,
                    "update_in_progress": self.in_progress(), "updates": self.updates,
                    "failed_updates": self.failed_updates, "failures": dict(self.failures),
                    "last_update": self.last_update, **self.totals}

    def _mark_inconsistent(self, reason: str) -> None:
        self._consistent, self._reason = False, reason

    def fail(self, kind: str) -> None:
        """Count a failure of ``kind`` (e.g. ``"finalize"``), in the metrics too."""
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1
        rdt_metrics.record_failure(kind)

    def _names(self) -> Optional[List[str]]:
        try:
            return list(self._param_names()) if self._param_names else None
        except Exception:  # pragma: no cover - the model is gone (shutdown)
            return None


def format_update(summary: Dict[str, Any], rank: str = "") -> str:
    """The one log line of an ended update."""
    where = f" {rank}" if rank else ""
    total = summary.get("params_total")
    of = f" of {total}" if total is not None else ""
    writers = summary.get("writers", 0)
    return (
        f"[RDT] weight update{where} done: weight_version={summary.get('weight_version')} tensors={summary['tensors']} "
        f"bytes={summary['bytes']} ({summary['bytes'] / 2**20:.2f} MiB) in {summary['pulls']} pulls, "
        f"{summary.get('params_updated', 0)}{of} parameters updated by {writers} writer{'s' if writers != 1 else ''} "
        f"({summary.get('rewrites', 0)} rewritten), transfer {summary['transfer_seconds']:.4f} s "
        f"({summary['gbps']:.3f} GB/s), update {summary['update_seconds']:.3f} s, transport={summary['transport']}"
        + (f", cache flushed={summary['flushed_cache']}" if "flushed_cache" in summary else "")
        + "".join(f", LoRA {name}: {n} bytes" for name, n in (summary.get("adapters") or {}).items())
    )
