"""The rank core of RDT weight sync (:class:`RankWeightSync`), reaching the scheduler only through its port.

Threads: the scheduler's loop thread runs every pull, begin, finalize and abort at its safe point; Ray's actor threads
and the lane's threads only queue that work and wait (status runs on them). Locks, taken in this order: the receiver's,
the update state's (never held while taking another), the same-node reader's."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from sglang.srt.ray.rdt.defaults import PAUSE_GRACE_S, PULL_TIMEOUT_S, SAFE_POINT_TIMEOUT_S
from sglang.srt.ray.rdt.engine.lora_sync import RankLoRA
from sglang.srt.ray.rdt.engine.rank_status import RankStatus, parameter_checksums, parameter_layout
from sglang.srt.ray.rdt.engine.receiver import RdtWeightReceiver
from sglang.srt.ray.rdt.engine.scheduler_port import SchedulerPort
from sglang.srt.ray.rdt.engine.sources import sources_of
from sglang.srt.ray.rdt.engine.update_state import RankUpdateState
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError, WeightUpdateConflictError
from sglang.srt.ray.rdt.transport import same_node

logger = logging.getLogger(__name__)

NOT_PAUSED = "generation is not paused"
NOT_PAUSED_IN_SESSION = ("a weight-update session is open but generation is not paused, so requests would be "
                         "answered between pulls from a partly written model")
_NOT_PAUSED_YET = object()

NOT_QUIESCED = ("refusing to pull weights while generation may run on this rank: {why}. Pause generation first — "
                "POST /pause_generation (mode abort, retract or in_place), then POST /begin_weight_update; "
                "POST /weight_sync/begin, RayEngine.begin_weight_sync() and WeightSyncClient.update() drain "
                "in-flight requests and pause instead — and end the update with POST /end_weight_update and "
                "/continue_generation.")
CONTINUED_MID_UPDATE = ("generation continued while an update that had written weights was still open: requests "
                        "may have been answered from a partly written model until the update ends")


def failure_kind(exc: BaseException) -> Optional[str]:
    """The failure ``kind`` of a failed pull the update state has not counted itself."""
    if isinstance(exc, (WeightsInconsistentError, WeightUpdateConflictError)):
        return None
    return "rejected" if isinstance(exc, WeightSyncError) else "other"


class RankWeightSync:
    def __init__(self, port: SchedulerPort, safe_point, *, rank: str = "",
                 device: Optional[torch.device] = None, pull_timeout_s: float = PULL_TIMEOUT_S,
                 registration_disabled_reason: Optional[str] = None, transports: Sequence[str] = ("NIXL",)):
        self.port = port
        self.device = device
        self.safe_point = safe_point
        self.transports = list(transports)
        self.state = RankUpdateState(param_names=self._model_param_names, rank=rank, weight_version=port.weight_version)
        self.lora = RankLoRA(port)
        self.receiver = RdtWeightReceiver(lambda: dict(self._params()), device=device, pull_timeout_s=pull_timeout_s,
                                          registration_disabled_reason=registration_disabled_reason, state=self.state)
        self.lane = None  # a RankLane once a trainer on this node opened one
        self._lane_lock = threading.Lock()  # guards making the lane (once)
        self._refresh_posted = False  # prepare_next_pull's walk is queued
        self.idle_sleep = "off"  # how the loop's --sleep-on-idle wait meets queued calls (the actor says)
        self.group = None  # GroupCalls of a TP/PP group (managers/scheduler_group_calls.py); None: a group of one rank

    def _model_param_names(self) -> List[str]:
        names = self.receiver.param_names()  # (adapters' tensors are named "{lora_name}:{key}")
        return [n for n in names if ":" not in n] if self.lora.stashes.stashes else names

    def _params(self):
        """What a pull may write: the model's parameters and the registered adapters' tensors."""
        yield from self.port.named_parameters()
        yield from self.lora.named_tensors()

    def open_lane(self, sender: str, pid: int = 0, probe=None) -> Dict[str, Any]:
        """The call lane for trainer ``sender``, or ``{"unreadable": why}`` if this rank cannot read ``probe``."""
        why = None if probe is None else self._probe_read(probe)
        if why is not None:
            return {"node_id": same_node.node_id(), "unreadable": why}
        with self._lane_lock:  # (two trainers at once: one lane)
            if self.lane is None:
                from sglang.srt.ray.rdt.engine.local_lane import RankLane

                self.lane = RankLane(self, after_reply=self.prepare_next_pull)
        return {**self.lane.open(sender, pid), "node_id": same_node.node_id(), "gpu": same_node.gpu_uuid(self.device)}

    def _probe_read(self, probe) -> Optional[str]:
        device = self.device if self.device is not None else torch.device("cpu")
        why = same_node.unusable(probe, device)
        if why is not None:
            return why
        into = torch.empty(256, dtype=torch.uint8, device=device)
        try:
            same_node.read(probe, same_node.Targets.of([into]), device)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        if not torch.equal(into.cpu(), torch.arange(256, dtype=torch.uint8)):
            return "a probe read returned other bytes than the trainer's"
        return None

    def release_sender(self, sender: Optional[str] = None) -> int:
        n = same_node.release(sender)
        if n:
            logger.info("[RDT] closed %d kept CUDA IPC mappings of sender %s", n, sender or "(all)")
        return n

    def on_scheduler(self, fn, timeout_s: float = SAFE_POINT_TIMEOUT_S):
        """Run ``fn()`` on the scheduler thread at its next safe point."""
        return self.safe_point.call(None, lambda _scheduler: fn(), timeout_s)

    def quiesced(self) -> Optional[str]:
        """None when a pull is safe now (generation paused, no batch running), else why not."""
        if not self.port.paused():
            return NOT_PAUSED_IN_SESSION if self.port.session_open() else NOT_PAUSED
        try:
            idle = self.port.idle()
        except Exception as e:  # pragma: no cover - defensive
            return f"could not tell whether a batch is running ({e})"
        return None if idle else "a batch is still running (paused in place?)"

    def pull(self, refs, names, timeout: Optional[float] = None) -> Dict[str, Any]:
        """``pull_weights``: land the refs' tensors (quiesced)."""
        return self._pull(lambda: sources_of(refs), names, timeout)

    def pull_sources(self, sources, names, timeout: Optional[float] = None, key: Any = None, grant: bool = False):
        """Pull lane ``sources``; ``grant``: let their trainer write them itself instead (``receiver.pull``)."""
        return self._pull(lambda: sources, names, timeout, key, grant)

    def _pull(self, make_sources, names, timeout: Optional[float], key: Any = None, grant: bool = False):
        def run():
            why = self.quiesced()
            if why is None:
                return self.receiver.pull(make_sources(), names, timeout, key, grant)
            if why in (NOT_PAUSED, NOT_PAUSED_IN_SESSION):
                return why, _NOT_PAUSED_YET  # maybe the pause is still on its way
            raise WeightSyncError(NOT_QUIESCED.format(why=why))

        budget = (timeout or self.receiver.pull_timeout_s) + SAFE_POINT_TIMEOUT_S
        try:
            # A /pause_generation that returned may reach the scheduler an iteration later: look again briefly.
            deadline = time.monotonic() + PAUSE_GRACE_S
            while True:
                out = self.on_scheduler(run, budget)
                if not (isinstance(out, tuple) and out[1] is _NOT_PAUSED_YET):
                    return out
                if time.monotonic() > deadline:
                    raise WeightSyncError(NOT_QUIESCED.format(why=out[0]))
                time.sleep(0.01)
        except BaseException as e:
            kind = failure_kind(e)
            if kind is not None:
                self.state.fail(kind)
            raise

    def prepare_sources(self, sources, names, key: Any = None) -> Dict[str, Any]:
        """Plan a lane pull and map its kept segments, writing nothing (no pause needed)."""
        return self.on_scheduler(lambda: self.receiver.prepare(sources, names, key))

    def prepare_next_pull(self) -> None:
        """Queue the next pull's walk of the model for the next safe point (once an answer has left)."""
        if not self.receiver.needs_refresh():
            self._refresh_posted = False  # walked (here or in a pull): post again next time
            return
        if self._refresh_posted:
            return  # one walk for several events in a row
        self._refresh_posted = True

        def refresh(_scheduler):
            self._refresh_posted = False
            self.receiver.refresh()
            same_node.release(gone_only=True)  # kept mappings of trainers that exited

        if not self.safe_point.post(refresh):
            self._refresh_posted = False  # no loop to take it: the next pull walks

    def on_group(self, op: str, *args):
        """Run ``op`` on every rank of this TP/PP group in the same loop iteration (a group call from its
        first rank): these run collectives, which must never meet the loop's own."""
        if self.group is None:
            return self.on_scheduler(lambda: self.group_op(op, args))
        if not self.group.entry:
            raise WeightSyncError(f"{op} acts on every rank of a tensor/pipeline-parallel group at once: call it on "
                                  f"the group's first rank (tp_rank 0, pp_rank 0), not on rank {self.state.rank}")
        from sglang.srt.managers.scheduler_group_calls import GroupCallError

        try:
            return self.group.call(op, args, SAFE_POINT_TIMEOUT_S)
        except GroupCallError as e:
            raise WeightSyncError(f"{op} failed: {e}") from e

    def group_op(self, op: str, args: tuple):
        """One rank's part of a group call (on its scheduler thread)."""
        if op == "begin":
            self.port.begin_session()
            return {"success": True}
        if op == "finalize":
            return self._finalize_here(*args)
        if op == "abort":
            return self._abort_here(*args)
        if op == "lora_register":
            out = self.lora.register(*args)
            if out["status"] != "unchanged":
                self.receiver.on_weights_loaded()  # new stash tensors: the next pull walks
            return out
        raise WeightSyncError(f"unknown group call {op!r}")

    def register_lora(self, lora_name: str, config: Dict[str, Any], lora_id: str) -> Dict[str, Any]:
        try:
            return self.on_group("lora_register", lora_name, dict(config), lora_id)
        finally:
            self.prepare_next_pull()

    def begin(self) -> Dict[str, Any]:
        return self.on_group("begin")

    def finalize(self, weight_version: Optional[str] = None, flush_cache: bool = True,
                 walk_after: bool = True) -> Dict[str, Any]:
        """End the update: version, flush, state, post-load. ``walk_after=False``: the caller runs
        :meth:`prepare_next_pull` once its answer left (the lane does)."""
        try:
            return self.on_group("finalize", weight_version, flush_cache)
        except WeightSyncError:
            raise
        except BaseException:
            self.state.fail("finalize")
            raise
        finally:
            if walk_after:
                self.prepare_next_pull()

    def _finalize_here(self, weight_version: Optional[str], flush_cache: bool) -> Dict[str, Any]:
        in_session = self.port.session_open()
        if not in_session:
            why = self.quiesced()
            if why is not None:  # refused before anything changes, the version too
                raise WeightSyncError("refusing to finalize while generation may run: " + why)
        if weight_version is not None:
            self.port.record_weight_version(str(weight_version))
        summary = self._end_update(flush_cache)
        # sglang's own end (post-load); its listener finds the update ended already.
        problem = self.port.end_session() if in_session else self.port.run_post_load()
        if not summary["consistent"] or problem:
            raise WeightSyncError(f"the update ended inconsistent: {summary.get('inconsistent_reason') or problem}")
        return {"success": True, "flushed_cache": bool(summary.get("flushed_cache")),
                "weight_version": self.port.weight_version(), "update": summary}

    def abort(self, reason: str) -> Dict[str, Any]:
        try:
            return self.on_group("abort", reason)
        finally:
            self.prepare_next_pull()

    def _abort_here(self, reason: str) -> Dict[str, Any]:
        if self.port.session_open():
            self.port.end_session(abort=reason)  # its listener drops the update
        else:
            self._drop(reason)  # (an update under a plain pause: this rank's alone)
        return self.state.status()

    def _drop(self, reason: str) -> None:
        """Drop the open update here: its adapters back to what is served, the state aborted, the next pull walks."""
        self.lora.drop(self.state)
        self.state.abort(reason)
        self.receiver.end_of_update()

    def writer_gone(self, writer, how: str) -> None:
        """A trainer process left with the update it wrote in still open: the weights are inconsistent until
        a complete update ends; an update under a plain pause is aborted (a session ends or expires itself)."""
        reason = f"{writer.label} {how} before the update it wrote in ended"
        kind = self.state.writer_gone(writer.id, reason)
        if kind is None:
            return
        logger.error("[RDT] %s; weights inconsistent until a complete update ends", reason)
        if kind == "paused":  # (no session: no collective, this rank's update alone)
            try:
                self.on_scheduler(lambda: self._abort_here(reason) if not self.port.session_open() else None)
            except Exception as e:  # e.g. the loop is gone: the state says it already
                logger.warning("[RDT] aborting the update after its writer left failed: %s", e)

    def _end_update(self, flush: bool) -> Dict[str, Any]:
        """The update's end (scheduler thread): commit adapters, flush if asked, close the state; its summary."""
        extra = {}
        adapters = self.lora.end(self.state, self.port.weight_version())
        if adapters is not None:
            extra["adapters"] = adapters
        if flush and self.state.wrote_weights:
            extra["flushed_cache"] = self.port.flush_cache()
            if not extra["flushed_cache"]:
                logger.warning("[RDT] the prefix cache could not be flushed after the update; "
                               "call /flush_cache before generation continues")
        summary = self.state.end(**extra)
        self.receiver.end_of_update()
        return summary

    def on_weights_released(self) -> None:
        self.receiver.on_weights_released()

    def on_weights_resumed(self) -> None:
        self.receiver.on_weights_resumed()

    def on_weights_loaded(self, source: str) -> None:
        self.receiver.on_weights_loaded()  # sglang's own update_weights_from_* (post-load may replace parameters)
        self.prepare_next_pull()

    def on_weight_update_begin(self) -> None:
        self.state.begin()

    def on_weight_update_end(self, aborted: Optional[str] = None) -> Optional[str]:
        """sglang's ``end_weight_update``: end the update, or drop it (``aborted``); why it is not clean, or None."""
        if not self.state.update_open:
            return None  # ended (finalize) or aborted already
        if aborted is not None:
            self._drop(aborted)
            self.prepare_next_pull()
            return None
        summary = self._end_update(flush=True)
        self.prepare_next_pull()
        return None if summary["consistent"] else summary["inconsistent_reason"]

    def on_generation_continued(self) -> None:
        if self.state.update_kind == "paused":
            # Pulls under a plain pause that nobody finalized: post-load them now.
            logger.info("[RDT] continue_generation ends the update made under the pause")
            self._end_update(flush=True)
            self.port.run_post_load()
        elif self.state.wrote_weights and self.state.interrupted(CONTINUED_MID_UPDATE):
            logger.error("[RDT] %s", CONTINUED_MID_UPDATE)

    def status(self) -> RankStatus:
        st = RankStatus(**self.state.status(), **self.receiver.status(), transports=list(self.transports),
                        lane=self.lane.status() if self.lane is not None else {"open": False},
                        kept_mappings=same_node.stats(), event_loop=self.safe_point.state, idle_sleep=self.idle_sleep,
                        group_entry=self.group is None or self.group.entry, lora_adapters=self.lora.status())
        if "SGLANG_IPC" in self.transports:
            try:
                from sglang.srt.ray.rdt.transport.cuda_driver import device_uuid

                st.ipc_reach = same_node.reach()
                if self.device is not None and self.device.type == "cuda":
                    st.device_uuid = device_uuid(self.device.index or 0)
            except Exception as e:  # pragma: no cover - status must answer
                logger.warning("[RDT] same-node reach unknown: %s", e)
        return st

    def stats(self) -> Dict[str, Any]:
        st = self.state.status()
        keys = ("updates", "failed_updates", "failures", "last_update", "update_in_progress", "weight_version")
        return {**{k: st[k] for k in keys},
                "pulls": {k: st[k] for k in ("pulls", "failed_pulls", "tensors", "bytes", "seconds")},
                "last_pull": st["last_pull"]}

    def parameter_layout(self) -> Dict[str, Dict[str, Any]]:
        return parameter_layout(self._params())

    def parameter_checksums(self) -> Dict[str, str]:
        return self.on_scheduler(lambda: parameter_checksums(self._params()))

    def shutdown(self) -> int:
        if self.lane is not None:
            self.lane.close()
        n = self.receiver.deregister()
        self.receiver.close()
        return n
