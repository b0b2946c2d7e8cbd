"""The receiving side of RDT weight sync: a pull is plan -> admit -> read -> record, into live parameters.

A source that fails after a byte may have landed leaves the weights inconsistent until a clean update ends."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from sglang.srt.ray.rdt.defaults import PULL_TIMEOUT_S
from sglang.srt.ray.rdt.engine.plan import PlanCache, group_names
from sglang.srt.ray.rdt.engine.registration import ParameterRegistration, RegistrationBook, warn_if_expandable_segments
from sglang.srt.ray.rdt.engine.sources import NotReadable, RefSource
from sglang.srt.ray.rdt.engine.update_state import RankUpdateState
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError, describe
from sglang.srt.ray.rdt.transport import nixl_threads, same_node
from sglang.srt.ray.rdt.transport.metadata import MappingFailed

logger = logging.getLogger(__name__)

# A NIXL pull at least this large and slower than this fell back to TCP (no GPU path).
SLOW_NIXL_MIN_BYTES = 64 << 20
SLOW_NIXL_BPS = 2e9
SLOW_NIXL = ("[RDT] a NIXL pull of %.1f MiB ran at %.2f GB/s: UCX found no GPU path and fell back to TCP. Causes "
             "seen: trainer and rank on the same GPU (use transport 'SGLANG_IPC' or WeightSyncClient, which read over "
             "CUDA IPC there); tensors in expandable segments (unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True);"
             " no RDMA between nodes. UCX_PROTO_INFO=y prints the protocol UCX picked.")


class RdtWeightReceiver:
    """Pull sources into the live parameters returned by ``get_params``."""

    def __init__(self, get_params: Callable[[], Mapping[str, torch.Tensor]], *, device: Optional[torch.device] = None,
                 pull_timeout_s: float = PULL_TIMEOUT_S, registration_disabled_reason: Optional[str] = None,
                 registrations: Optional[RegistrationBook] = None, state: Optional[RankUpdateState] = None):
        self._device = device
        self.pull_timeout_s = pull_timeout_s
        # Guards the plans, registrations, _closed/_weights_released; never taken under the update state's lock.
        self._lock = threading.Lock()
        self._closed = False
        self._weights_released = False
        self._slow_nixl_warned = False
        self._plans = PlanCache(get_params)
        self._nixl_book = registrations is None  # (a given book registers its own way)
        self._registration = ParameterRegistration(get_params, self._plans, registration_disabled_reason, registrations)
        self.state = state or RankUpdateState(param_names=lambda: list(get_params()))

    def register(self) -> Dict[str, Any]:
        reason = self._registration.disabled_reason
        if reason:
            logger.info("[RDT] register_weight_for_rdt skipped: %s", reason)
            return {"registered": False, "reason": reason}
        with self._lock:
            self._enter(pulling=False)
            t0 = time.perf_counter()
            if self._nixl_book:
                nixl_threads.start_nixl_agent()  # its progress thread at idle priority
            changes = self._registration.register()
            if self._device is not None and self._device.type == "cuda":
                same_node.warm(self._device)  # the copy kernel is built before any pull needs it
            dt = time.perf_counter() - t0
        book = self._registration.book
        logger.info("[RDT] registered %d parameter storages (%.1f MiB) with NIXL in %.3f s",
                    len(book), book.nbytes / 2**20, dt)
        return {"registered": True, "new_registrations": changes["added"],
                "dropped_stale_registrations": changes["dropped"],
                "registrations": len(book), "bytes": book.nbytes, "seconds": dt}

    def deregister(self) -> int:
        with self._lock:
            self._registration.wanted = False
            return self._registration.release()

    # Memory saver: storage keeps its address but loses its pages, and its registration with them.
    def on_weights_released(self) -> None:
        with self._lock:
            self._weights_released = True
            self._registration.release()

    def on_weights_resumed(self) -> None:
        with self._lock:
            self._weights_released = False
            self._registration.resumed()

    def on_weights_loaded(self) -> None:
        """sglang loaded weights its own way, or an update ended: the next pull walks the model first."""
        with self._lock:
            self._plans.mark_stale()

    end_of_update = on_weights_loaded

    def close(self) -> None:
        """Release registrations and kept mappings; refuse later pulls."""
        self.deregister()
        with self._lock:
            self._closed = True
        same_node.release()

    def needs_refresh(self) -> bool:
        return self._plans.stale

    def refresh(self) -> bool:
        """Do now what the next pull would do first: walk, keep unmoved plans, move the registrations."""
        with self._lock:
            if self._closed or self._weights_released:
                return False
            walked = self._plans.refresh()
            if walked:
                self._registration.after_walk()
            return walked

    def param_names(self) -> List[str]:
        return self._plans.param_names()

    @property
    def registered(self) -> bool:
        return bool(self._registration.book)

    def status(self) -> Dict[str, Any]:
        return {"registered": self.registered, "registrations": len(self._registration),
                "weights_released": self._weights_released,
                "registration_disabled_reason": self._registration.disabled_reason}

    def _enter(self, pulling: bool = True) -> None:
        if self._closed:
            raise WeightSyncError("the engine is shut down; this rank accepts no more pulls")
        if pulling and self._weights_released:
            raise WeightSyncError("weights are released (memory saver); resume memory occupation before pulling")
        # CUDA's current device is per thread, and Ray runs actor methods on other threads.
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    def prepare(self, sources: Sequence[Any], names, key: Any = None) -> Dict[str, Any]:
        """Plan ``sources`` and map a lane source's kept segments, writing nothing; needs no pause."""
        t0 = time.perf_counter()
        with self._lock:
            self._enter()
            specs = [s.specs(self.pull_timeout_s) for s in sources]
            if key is None:
                names = group_names(names, [len(s) for s in specs])
            plan, _, reused = self._plans.plan(specs, names, key)
            opened = sum(s.read(t, self._device, self.pull_timeout_s, copy=False).opened
                         for s, t in zip(sources, plan.targets))
        return {"tensors": plan.count, "plan_reused": reused, "opened": opened, "seconds": time.perf_counter() - t0}

    def pull(self, sources: Sequence[Any], names, timeout_s: Optional[float] = None, key: Any = None,
             grant: bool = False) -> Dict[str, Any]:
        """Land ``sources`` in parameters ``names`` (flat, or per source); ``key``: the layout's identity. ``grant``:
        land nothing; after a pull's checks, describe the targets for the lane source's trainer to write and confirm."""
        timeout_s = self.pull_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            self._enter()
            t0 = time.perf_counter()
            plan, writes, reused = self._plan(sources, names, timeout_s, key)
            t_plan = time.perf_counter() - t0
            if grant:
                try:
                    targets = same_node.writable(plan.targets[0], self._device)
                except Exception as e:  # (nothing granted yet)
                    raise MappingFailed(f"the trainer cannot write this rank's parameters: {describe(e)}") from e
                return {"grant": self.state.granted(*writes[0]), "targets": targets, "tensors": plan.count,
                        "bytes": plan.nbytes, "plan_seconds": t_plan}
            reads = self._transfer(sources, plan, writes, timeout_s)
            t_fetch = time.perf_counter() - t0 - t_plan
            return self._record(plan, writes, reads, reused, t_plan, t_fetch, t0)

    def _plan(self, sources, names, timeout_s: float, key: Any):
        specs = [s.specs(timeout_s) for s in sources]
        if key is None:  # (a keyed layout's names were checked when it was defined)
            names = group_names(names, [len(s) for s in specs])
        plan, walked, reused = self._plans.plan(specs, names, key)
        if any(isinstance(s, RefSource) for s in sources):  # NIXL reads need registrations
            self._registration.sync_for_pull([t.tensors for t in plan.targets], walked, reused)
        if not reused:
            warn_if_expandable_segments([t for ts in plan.targets for t in ts.tensors])
        writes = [(ns, s.writer()) for ns, s in zip(names, sources)]
        self.state.admit(writes)  # no parameter written by two writers
        return plan, writes, reused

    def _transfer(self, sources, plan, writes, timeout_s: float):
        t1 = time.perf_counter()
        reads = []
        try:
            for source, targets in zip(sources, plan.targets):
                reads.append(source.read(targets, self._device, timeout_s))
        except BaseException as e:
            if not reads and isinstance(e, NotReadable):
                raise  # refused before any byte moved
            names = [n for ns, _ in writes for n in ns]
            reason = (f"a pull of {plan.count} tensors failed mid-transfer after {time.perf_counter() - t1:.2f} s "
                      f"({type(e).__name__}); some parameters may hold new bytes and others old ones")
            self.state.transfer_failed(names, reason)
            self._plans.forget()
            logger.error("[RDT] %s: %s", reason, e)
            raise WeightsInconsistentError(f"{reason}. The engine reports its weights as inconsistent until a complete "
                                           f"update ends. Cause: {type(e).__name__}: {e}") from e
        return reads

    def _record(self, plan, writes, reads, reused, t_plan, t_fetch, t0) -> Dict[str, Any]:
        transports = sorted({r.label for r in reads})
        nixl_bytes = sum(r.bytes for r in reads if r.path == "nixl")
        nixl_s = sum(r.seconds for r in reads if r.path == "nixl")
        if (nixl_bytes >= SLOW_NIXL_MIN_BYTES and nixl_s > 0 and nixl_bytes / nixl_s < SLOW_NIXL_BPS
                and not self._slow_nixl_warned):
            self._slow_nixl_warned = True
            logger.warning(SLOW_NIXL, nixl_bytes / 2**20, nixl_bytes / nixl_s / 1e9)
        seconds = time.perf_counter() - t0
        stats = {
            "tensors": plan.count, "bytes": plan.nbytes, "seconds": seconds, "fetch_seconds": t_fetch,
            "plan_seconds": t_plan, "gbps": plan.nbytes / t_fetch / 1e9 if t_fetch > 0 else float("inf"),
            "sources": len(reads), "transports": transports, "transport": ",".join(transports),
            "registered": self.registered, "plan_reused": reused, "reads": [r.__dict__ for r in reads],
            "timing": {"pull_start": t0, "pull_end": t0 + seconds},
        }
        self.state.landed(writes, stats)
        level = logging.DEBUG if reused else logging.INFO
        logger.log(level, "[RDT] pulled %d tensors, %.1f MiB in %.3f s (%.2f GB/s, transport=%s)",
                   plan.count, plan.nbytes / 2**20, t_fetch, stats["gbps"], stats["transport"])
        return stats
