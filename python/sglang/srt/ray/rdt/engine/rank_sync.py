"""The rank core of RDT weight sync: one object per rollout rank.

:class:`RankWeightSync` owns everything a rank knows about weight updates —
its :class:`~.update_state.RankUpdateState` (open/closed, writers,
consistency, counters, version is read from the scheduler), its
:class:`~.receiver.RdtWeightReceiver` (registration, plans, transfers) and
the rule that no byte lands beside a forward pass: every call that touches
the model runs on the scheduler's own thread at its safe point
(:class:`~sglang.srt.managers.scheduler_safe_point.SafePointQueue`), and a
pull is refused unless the rank is quiesced — generation paused (any mode)
or a weight-update session open, and no batch running.

It reaches the scheduler only through a
:class:`~.scheduler_port.SchedulerPort`, so the SchedulerActor
(``actor_mixin.py``) and the GPU benchmark's rank (a plain PyTorch model
whose loop serves the same queue) run this same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from typing import Any, Dict, Optional, Sequence

import torch

from sglang.srt.ray.rdt.defaults import PAUSE_GRACE_S, PULL_TIMEOUT_S, SAFE_POINT_TIMEOUT_S
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.scheduler_port import SchedulerPort
from sglang.srt.ray.rdt.engine.update_state import RankUpdateState
from sglang.srt.ray.rdt.errors import (
    WeightsInconsistentError,
    WeightSyncError,
    WeightUpdateConflictError,
)

logger = logging.getLogger(__name__)

NOT_PAUSED = "no weight-update session is open and generation is not paused"
_NOT_PAUSED_YET = object()

NOT_QUIESCED = (
    "refusing to pull weights while generation may run on this rank: {why}. "
    "Pause generation first — POST /pause_generation (mode abort, retract or "
    "in_place), then POST /begin_weight_update; POST /weight_sync/begin, "
    "RayEngine.begin_weight_sync() and WeightSyncClient.update() drain in-flight "
    "requests and hold new ones instead — and end the update with "
    "POST /end_weight_update and /continue_generation."
)


def failure_kind(exc: BaseException) -> Optional[str]:
    """The failure ``kind`` of a failed pull that the update state has not
    counted itself (it counts conflicts and broken transfers)."""
    if isinstance(exc, (WeightsInconsistentError, WeightUpdateConflictError)):
        return None
    if isinstance(exc, WeightSyncError):
        return "rejected"
    return "other"


class RankWeightSync:
    def __init__(
        self,
        port: SchedulerPort,
        safe_point,
        *,
        rank: str = "",
        device: Optional[torch.device] = None,
        pull_timeout_s: float = PULL_TIMEOUT_S,
        registration_disabled_reason: Optional[str] = None,
        transports: Sequence[str] = ("NIXL",),
    ):
        self.port = port
        self.device = device
        self.safe_point = safe_point
        self.rank = rank
        self.transports = list(transports)
        self.flush_at_end = True  # finalize(flush_cache=False) clears it for its update
        self.state = RankUpdateState(
            # the receiver's last walk of the model (no walk of its own per update)
            param_names=lambda: self.receiver.param_names(),
            rank=rank,
            weight_version=port.weight_version,
        )
        self.receiver = RdtWeightReceiver(
            lambda: dict(port.named_parameters()),
            device=device,
            pull_timeout_s=pull_timeout_s,
            registration_disabled_reason=registration_disabled_reason,
            state=self.state,
        )
        self.lane = None  # a RankLane once a trainer on this node opened one
        self._folding = False  # an update is ending inside a pull call
        self._refresh_posted = False  # prepare_next_pull's walk is queued

    def open_lane(self, sender: str, pull=None) -> Dict[str, Any]:
        """The same-node call lane (:mod:`.local_lane`) for trainer process
        ``sender``: its address and secret. Its refs are kept from now on.
        A lane call runs :meth:`pull` (or ``pull``, the same call wrapped)."""
        if self.lane is None:
            from sglang.srt.ray.rdt.engine.local_lane import RankLane

            self.lane = RankLane(pull or self.pull, after_reply=self.prepare_next_pull)
        out = self.lane.open(sender)
        from sglang.srt.ray.rdt.transport import sglang_ipc

        out["node_id"] = sglang_ipc.reach()["node_id"]
        return out

    def release_sender(self, sender: Optional[str] = None) -> int:
        """Close the cached mappings of ``sender``'s memory (every sender:
        None) and drop the refs the lane held for it."""
        if self.lane is not None:
            self.lane.release(sender)
        return self.receiver.release_sender(sender)

    def on_scheduler(self, fn, timeout_s: float = SAFE_POINT_TIMEOUT_S, lend: bool = False):
        """Run ``fn()`` on the scheduler thread at its next safe point
        (``lend``: or on this thread while the loop is parked in its idle
        wait — for work that stays inside this rank's weight-sync state and
        the parameters' bytes; never the update's end)."""
        return self.safe_point.call(None, lambda _scheduler: fn(), timeout_s, lend=lend)

    def quiesced(self) -> Optional[str]:
        """None when a pull is safe now, else why not (on the scheduler thread)."""
        if not (self.port.session_open() or self.port.paused()):
            return NOT_PAUSED
        try:
            idle = self.port.idle()
        except Exception as e:  # pragma: no cover - defensive
            return f"could not tell whether a batch is running ({e})"
        return None if idle else "a batch is still running (paused in place?)"

    # -- the update --------------------------------------------------------- #
    def pull(self, refs, names, timeout: Optional[float] = None,
             finalize: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Land the refs' tensors (scheduler thread, quiesced). ``finalize``
        (``{"weight_version", "flush_cache"}``, both optional): this was the
        rank's last pull of the update; end it here as :meth:`finalize` does,
        in the same safe-point task — the caller saves a round trip, the rank
        a hop to its loop. The result then carries the finalize's under
        ``"finalized"``; a pull that fails ends nothing."""
        end = None
        if finalize is not None:
            unknown = set(finalize) - {"weight_version", "flush_cache"}
            if unknown:  # checked before any byte moves
                raise WeightSyncError(
                    f"finalize= takes weight_version and flush_cache, not {sorted(unknown)}")
            version = finalize.get("weight_version")
            flush = bool(finalize.get("flush_cache", True))
            end = lambda: self._finalize_here(version, flush)  # noqa: E731
        return self._pull(refs, names, timeout, end)

    def _pull(self, refs, names, timeout: Optional[float], end=None) -> Dict[str, Any]:
        landed = False

        def run():
            nonlocal landed
            why = self.quiesced()
            if why is None:
                with self._scheduler_stream():
                    out = self.receiver.pull(refs, names, timeout)
                landed = True
                if self.lane is not None:
                    self.lane.keep(refs)
                if end is not None:
                    t0 = time.perf_counter()
                    self._folding = True  # the answer leaves from the caller's thread
                    try:
                        out["finalized"] = end()
                    finally:
                        self._folding = False
                    out["stages"]["finalize"] = time.perf_counter() - t0
                return out
            if why == NOT_PAUSED:
                return _NOT_PAUSED_YET  # maybe the pause is still on its way
            raise WeightSyncError(NOT_QUIESCED.format(why=why))

        budget = (timeout or self.receiver.pull_timeout_s) + SAFE_POINT_TIMEOUT_S
        try:
            # A /pause_generation that returned has been sent to this rank,
            # but the scheduler may take it in one loop iteration after this
            # call reached its safe point: look again for a moment first.
            deadline = time.monotonic() + PAUSE_GRACE_S
            while True:
                # (an update that ends here runs sglang's post-load: never lent)
                out = self.on_scheduler(run, budget, lend=end is None)
                if out is not _NOT_PAUSED_YET:
                    return out
                if time.monotonic() > deadline:
                    raise WeightSyncError(NOT_QUIESCED.format(why=NOT_PAUSED))
                time.sleep(0.01)
        except BaseException as e:
            if landed:  # the pull landed and the update's end failed: counted as finalize() does
                if not isinstance(e, WeightSyncError):
                    self.state.fail("finalize")
                raise
            kind = failure_kind(e)
            if kind is not None:
                self.state.fail(kind)
            raise

    def _scheduler_stream(self):
        """The scheduler thread's CUDA stream made current: a pull run on
        another thread (the safe point lent to it) starts its copies after the
        work the scheduler queued there (an update's post-load kernels)."""
        stream = self.port.stream() if self.device is not None and self.device.type == "cuda" else None
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def prepare_next_pull(self) -> None:
        """If the next pull would walk the model first (an update ended, a
        load replaced parameters), that walk runs at the scheduler's next
        safe point instead. The lane calls this once a pull's answer has
        left, so the work is off the critical path of both updates."""
        if not self.receiver.needs_refresh():
            self._refresh_posted = False  # walked (here or in a pull): post again next time
            return
        if self._refresh_posted:
            return  # one walk for several events in a row
        self._refresh_posted = True

        def refresh(_scheduler):
            self._refresh_posted = False
            self.receiver.refresh()

        if not self.safe_point.post(refresh):
            self._refresh_posted = False  # no loop to take it: the next pull walks

    def prepare(self, refs, names) -> Dict[str, Any]:
        """Check a pull and open what it reads from, writing nothing (scheduler
        thread; no pause needed): :meth:`RdtWeightReceiver.prepare`."""
        out = self.on_scheduler(lambda: self.receiver.prepare(refs, names), lend=True)
        if self.lane is not None:
            self.lane.keep(refs)
        return out

    def begin(self) -> Dict[str, Any]:
        def run():
            self.port.begin_session()
            return {"success": True}

        return self.on_scheduler(run)

    def finalize(self, weight_version: Optional[str] = None, flush_cache: bool = True) -> Dict[str, Any]:
        try:
            return self.on_scheduler(lambda: self._finalize_here(weight_version, flush_cache))
        except WeightSyncError:
            raise
        except BaseException:
            self.state.fail("finalize")
            raise

    def _finalize_here(self, weight_version: Optional[str], flush_cache: bool) -> Dict[str, Any]:
        """The update's end, on the scheduler thread: version, post-load
        processing (or sglang's end_weight_update), flush."""
        in_session = self.port.session_open()
        if not in_session:
            why = self.quiesced()
            if why is not None:  # refused before anything changes, the version too
                raise WeightSyncError("refusing to finalize while generation may run: " + why)
        if weight_version is not None:
            self.port.record_weight_version(str(weight_version))
        self.flush_at_end = flush_cache
        try:
            problem = self.port.end_session() if in_session else self.end_paused_update()
        finally:
            self.flush_at_end = True
        flushed = (self.state.last_update or {}).get("flushed_cache", False)
        if flush_cache and not flushed:
            flushed = self.port.flush_cache()
        if problem:
            raise WeightSyncError(f"the update ended inconsistent: {problem}")
        return {
            "success": True,
            "flushed_cache": bool(flushed),
            "weight_version": self.port.weight_version(),
            "update": self.state.last_update,
        }

    def abort(self, reason: str) -> Dict[str, Any]:
        def run():
            status = self.state.abort(reason)  # first: the session's end is then a no-op
            if self.port.session_open():
                self.port.end_session()
            self._update_ended()
            return status

        return self.on_scheduler(run)

    def end_paused_update(self) -> Optional[str]:
        """Close an update made under a plain pause (no session): the model's
        post-load processing, then the update's end."""
        self.port.run_post_load()
        return self.on_update_end()

    def on_update_end(self) -> Optional[str]:
        """The update's end (scheduler thread): flush, close the state, tell
        the receiver. Returns why the update is not clean, or None."""
        extra = {}
        if self.flush_at_end and self.state.wrote_weights:
            # KV in the prefix cache was computed with the old weights; the
            # engine is paused, so nothing can be using it.
            extra["flushed_cache"] = self.port.flush_cache()
            if not extra["flushed_cache"]:
                logger.warning("[RDT] the prefix cache could not be flushed after the update; "
                               "call /flush_cache before generation continues")
        summary = self.state.end(**extra)
        self._update_ended()
        return None if summary["consistent"] else summary["inconsistent_reason"]

    def _update_ended(self) -> None:
        # Paused for the next update (miles' way): collection stays off until
        # generation continues (gc_pause).
        self.receiver.end_of_update(resume_gc=not self.port.paused())
        if self.lane is not None:
            self.lane.end_of_update()
        if not self._folding:
            # The next update's walk of the model runs at the next safe point
            # (after end_weight_update's answer left: this thread sends it).
            # An update that ends inside a pull call waits for that call's
            # answer to leave first (the lane's after_reply; through Ray the
            # next pull walks).
            self.prepare_next_pull()

    # -- the scheduler's weight events (managers/weight_listeners.py) --------- #
    def on_weights_released(self) -> None:
        self.receiver.on_weights_released()

    def on_weights_resumed(self) -> None:
        self.receiver.on_weights_resumed()

    def on_weights_loaded(self, source: str) -> None:
        # sglang's own update_weights_from_* (post-load may replace parameters)
        self.receiver.on_weights_loaded()
        self.prepare_next_pull()

    def on_weight_update_begin(self) -> None:
        self.state.begin()

    def on_weight_update_end(self) -> Optional[str]:
        if not self.state.update_open:
            return None  # aborted: abort() closed it already
        return self.on_update_end()

    def on_generation_continued(self) -> None:
        if self.state.update_kind == "paused":
            # Pulls under a plain pause that nobody finalized: the weights are
            # live now, so they get their post-load processing here.
            logger.info("[RDT] continue_generation ends the update made under the pause")
            self.end_paused_update()
        self.receiver.release_gc()

    # -- reading ------------------------------------------------------------ #
    def status(self) -> Dict[str, Any]:
        from sglang.srt.ray.rdt.transport import nixl_progress

        out = {
            **self.receiver.status(),
            "lane": self.lane.status() if self.lane is not None else {"open": False},
            "transports": list(self.transports),
            "nixl_progress_thread": nixl_progress.describe(),
        }
        if "SGLANG_IPC" in self.transports:
            # What a trainer needs to know to put without NIXL metadata (same
            # node, a GPU this rank sees) and to tell it shares this rank's GPU.
            try:
                from sglang.srt.ray.rdt.transport import sglang_ipc
                from sglang.srt.ray.rdt.transport.cuda_driver import device_uuid

                out["ipc_reach"] = sglang_ipc.reach()
                if self.device is not None and self.device.type == "cuda":
                    out["device_uuid"] = device_uuid(self.device.index or 0)
            except Exception as e:  # pragma: no cover - status must answer
                out["ipc_reach_error"] = str(e)
        return out

    def stats(self) -> Dict[str, Any]:
        st = self.state.status()
        return {
            "updates": st["updates"],
            "failed_updates": st["failed_updates"],
            "failures": st["failures"],
            "last_update": st["last_update"],
            "update_in_progress": st["update_in_progress"],
            "weight_version": st["weight_version"],
            "pulls": {k: st[k] for k in ("pulls", "failed_pulls", "tensors", "bytes", "seconds")},
            "last_pull": st["last_pull"],
        }

    def parameter_layout(self) -> Dict[str, Dict[str, Any]]:
        return parameter_layout(self.port.named_parameters())

    def parameter_checksums(self) -> Dict[str, str]:
        return self.on_scheduler(lambda: parameter_checksums(self.port.named_parameters()))

    def shutdown(self) -> int:
        if self.lane is not None:
            self.lane.close()
        n = self.receiver.deregister()
        self.receiver.close()
        return n


def parameter_layout(named_parameters) -> Dict[str, Dict[str, Any]]:
    """``{name: {"shape", "dtype", "data_ptr"}}``: what ``pull_weights`` expects."""
    return {
        name: {
            "shape": list(p.shape),
            "dtype": str(p.dtype).replace("torch.", ""),
            "data_ptr": p.data_ptr(),
        }
        for name, p in named_parameters
    }


def parameter_checksums(named_parameters) -> Dict[str, str]:
    """sha256 of every parameter's bytes."""
    out = {}
    for name, p in named_parameters:
        data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.sha256(data.tobytes()).hexdigest()
    return out
