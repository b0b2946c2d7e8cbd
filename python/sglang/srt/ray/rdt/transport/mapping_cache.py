"""Receiver side: the CUDA IPC mappings of senders' memory, and the copy plans
that point into them.

A stale mapping must never be read:

* mappings are keyed by (sender process, segment base) and used only when the
  current ref names the same handle and size; a different handle at that base
  (the sender freed the segment, a new one lives there) closes the old one;
* a copy plan records the cache's *generation*; closing any mapping bumps it
  and drops every plan, so no plan outlives a mapping it points into;
* mappings unused for ``max_idle_fetches`` fetches, and all mappings of the
  oldest sender once more than ``max_senders`` were seen, are closed;
  :meth:`MappingCache.close_all` keeps, on request, those of buffers their
  senders declared persistent (:mod:`.persistent`) that were used since the
  previous ``close_all`` (an update's end): a persistent segment no update
  reads any more (its owner freed it, or sends from elsewhere now) stays
  mapped for at most one more update.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from sglang.srt.ray.rdt.transport import cuda_driver
from sglang.srt.ray.rdt.transport.cuda_driver import CudaDriverError
from sglang.srt.ray.rdt.transport.metadata import FetchInfo, IpcPart, MappingFailed

logger = logging.getLogger(__name__)


@dataclass
class Mapping:
    handle: bytes
    size: int
    ptr: int
    ordinal: int
    last_used: int
    persistent: bool = False


@dataclass
class CopyPlan:
    """A checked, mapped and planned pull, kept for the next identical one."""

    key: tuple
    generation: int
    dst_ptrs: List[int]
    segments: List[Tuple[int, int, bytes]]
    tensors: List[Tuple[int, int, int]]
    copies: int
    queues: List[List[Tuple[int, int, int]]]
    streams: list
    batch: Optional[list]
    mappings: List[Mapping]

    def matches(self, generation: int, dst_ptrs: List[int], ipc: IpcPart) -> bool:
        return (
            self.generation == generation and self.dst_ptrs == dst_ptrs
            and self.segments == ipc.segments and self.tensors == ipc.tensors
        )


class MappingCache:
    max_idle_fetches = 64
    max_senders = 4
    max_plans = 16

    def __init__(self, enabled: bool = True):
        self.lock = threading.RLock()
        self.enabled = enabled  # False: every mapping is closed after its fetch
        self.mappings: Dict[Tuple[str, int], Mapping] = {}
        self.senders: List[str] = []  # oldest first
        self.plans: "OrderedDict[tuple, CopyPlan]" = OrderedDict()
        self.fetches = 0
        self.generation = 0  # bumped whenever a mapping closes
        self.mark = 0  # `fetches` at the last close_all (an update's end)
        self._pending_close: List[Tuple[str, int]] = []

    # -- plans ------------------------------------------------------------ #
    def plan(self, key: tuple, dst_ptrs: List[int], ipc: IpcPart) -> Optional[CopyPlan]:
        """The plan of an identical earlier pull, if every mapping it uses is open."""
        plan = self.plans.get(key)
        if plan is None or not self.enabled or not plan.matches(self.generation, dst_ptrs, ipc):
            self.plans.pop(key, None)
            return None
        self.plans.move_to_end(key)
        self.touch_sender(ipc.sender)
        return plan

    def keep_plan(self, key: tuple, plan: CopyPlan) -> None:
        if not self.enabled:
            return
        self.plans[key] = plan
        while len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)

    # -- mappings --------------------------------------------------------- #
    def touch_sender(self, sender: str) -> None:
        if not self.senders or self.senders[-1] != sender:
            if sender in self.senders:
                self.senders.remove(sender)
            self.senders.append(sender)

    def map_segments(self, ipc: IpcPart, ordinal: int, info: FetchInfo) -> List[int]:
        """Pointers, in this process, of every segment of ``ipc`` (opened or reused)."""
        drv = cuda_driver.driver()
        self.touch_sender(ipc.sender)
        out = []
        opened_now: List[Tuple[str, int]] = []
        drv.push(ordinal)
        try:
            for base, size, handle in ipc.segments:
                key = (ipc.sender, base)
                m = self.mappings.get(key)
                if m is not None and (m.handle != handle or m.size != size or m.ordinal != ordinal):
                    self.close(key)  # the sender freed that segment; a new one lives there
                    m = None
                if m is None:
                    try:
                        ptr = drv.ipc_open(handle)
                    except CudaDriverError as e:
                        for k in opened_now:
                            self.close(k)
                        raise MappingFailed(f"cuIpcOpenMemHandle: {e}") from e
                    m = self.mappings[key] = Mapping(
                        handle, size, ptr, ordinal, self.fetches, persistent=ipc.persistent
                    )
                    opened_now.append(key)
                    info.opened += 1
                else:
                    info.reused += 1
                m.last_used = self.fetches
                out.append(m.ptr)
        finally:
            drv.pop()
        if not self.enabled:
            self._pending_close = list(opened_now)
        return out

    def used(self, plan: CopyPlan, sender: str) -> None:
        """After queuing ``plan``'s copies: mark its mappings, evict idle ones."""
        for m in plan.mappings:
            m.last_used = self.fetches
        if not self.enabled:
            return  # closed after the copy (close_pending)
        while len(self.senders) > self.max_senders:
            old = self.senders.pop(0)
            for k in [k for k in self.mappings if k[0] == old]:
                self.close(k)
        if len(self.mappings) > len(plan.mappings):
            for k, m in list(self.mappings.items()):
                if self.fetches - m.last_used > self.max_idle_fetches:
                    self.close(k)

    def close(self, key) -> None:
        m = self.mappings.pop(key, None)
        if m is None:
            return
        self.generation += 1  # a cached copy plan may point into it
        self.plans.clear()
        drv = cuda_driver.driver()
        drv.push(m.ordinal)
        try:
            drv.ipc_close(m.ptr)
        except CudaDriverError as e:  # pragma: no cover - best effort
            logger.warning("[RDT] closing a CUDA IPC mapping failed: %s", e)
        finally:
            drv.pop()

    def close_pending(self) -> None:
        for k in self._pending_close:
            self.close(k)
        self._pending_close = []

    def close_all(self, keep_persistent: bool = False) -> int:
        """Close cached mappings; with ``keep_persistent``, keep those of
        buffers their senders declared persistent."""
        with self.lock:
            keys = [
                k for k, m in self.mappings.items()
                if not (keep_persistent and m.persistent and m.last_used > self.mark)
            ]
            for k in keys:
                self.close(k)
            self.mark = self.fetches
            live = {k[0] for k in self.mappings}
            self.senders = [x for x in self.senders if x in live]
            return len(keys)

    def release_sender(self, sender: Optional[str] = None) -> int:
        """Close the mappings of one sender (all senders: ``None``)."""
        with self.lock:
            keys = [k for k in self.mappings if sender is None or k[0] == sender]
            for k in keys:
                self.close(k)
            self.senders = [x for x in self.senders if sender is not None and x != sender]
            return len(keys)

    def stats(self) -> Dict[str, int]:
        with self.lock:
            return {
                "mappings": len(self.mappings),
                "mapped_bytes": sum(m.size for m in self.mappings.values()),
                "senders": len(self.senders),
            }
