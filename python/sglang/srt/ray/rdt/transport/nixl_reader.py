"""Reads of RDT NIXL objects straight into their targets, with kept transfer requests.

A rank pulls the same layout from the same sender memory every update (a
trainer's registered buckets, a zero-copy trainer's kept parameters): the
same remote addresses, the same local parameters. Ray's NIXL manager
(``fetch_multiple_tensors``) treats every read as new. It deserializes the
descriptors, builds both descriptor lists tensor by tensor, loads the remote
agent's metadata again, makes a NIXL transfer request, posts it with a
notification for the sender, and releases it afterwards. The notification
is the costly part of a small read: the request completes only once the
sender's side has taken it in (on the CPU box: a small read takes ~0.5 ms
with it and ~0.05 ms without). Ray never reads these notifications; they
pile up in the sender's agent.

:class:`NixlReader` reads through the same agent (this process's Ray NIXL
agent, with its registrations and its cache of remote agents) but keeps each
transfer request, keyed by everything it was made from: the remote agent
(name, metadata version, metadata), the ref's serialized descriptors and the
targets' addresses and sizes. A later ref whose key matches reuses the
request: one ``transfer`` call, no notification. Anything else makes a new
request the same way Ray's manager would. Targets that are not registered
with NIXL, or a Ray whose remote-agent cache is off, go through Ray's manager
as before.

A kept request points into NIXL's records of the local registrations and of
the remote agent. Both can go away under it: Ray deregisters memory when its
reference count ends, and removes a remote agent whose metadata version
changed (the sender deregistered memory) or that falls out of its cache.
The reader therefore wraps the agent's ``deregister_memory`` and
``remove_remote_agent``: before either runs, the requests it would leave
dangling are released. A request that failed or timed out is dropped.

Contract of :meth:`NixlReader.read`: each job's targets match its ref's
tensors (count, byte size, element size, contiguous) — the receiver's plan
checked them before. Thread-safe; one reader per process
(:func:`reader`), as there is one Ray NIXL agent per process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang.srt.ray.rdt.transport import compat

logger = logging.getLogger(__name__)

# Kept transfer requests per process (least recently used dropped first):
# a rank keeps one per (bucket layout, sender memory); a few updates' worth.
MAX_KEPT = 256


class _Kept:
    __slots__ = ("handle", "remote", "nbytes")

    def __init__(self, handle, remote: str, nbytes: int):
        self.handle = handle
        self.remote = remote
        self.nbytes = nbytes


class NixlReader:
    """Reads RDT NIXL objects into their targets through this process's Ray NIXL agent."""

    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept = max_kept
        self._lock = threading.RLock()
        self._kept: "OrderedDict[tuple, _Kept]" = OrderedDict()
        self._hooked_agent = None
        self._mgr = None  # Ray's NIXL manager of this process (one per process)
        self._cache_size = 0  # of Ray's cache of remote agents
        self.counts = {"reused": 0, "made": 0, "released": 0, "through_ray": 0, "failed": 0}

    # ------------------------------------------------------------------ #
    # Reads
    # ------------------------------------------------------------------ #
    def read(self, jobs: Sequence[Tuple[str, Any, List[Any]]], timeout_s: float) -> List[Optional[list]]:
        """Read RDT objects' tensors into their targets.

        ``jobs``: ``[(object id, NIXL transport metadata, targets)]``. All
        reads are posted, then waited for together. Returns, per job, the
        targets, or None for a read that failed before anything was posted
        (nothing written: ``ray.get`` can still fetch it, or say why not).
        Raises ``TimeoutError`` after ``timeout_s`` and ``RuntimeError`` when
        a posted read broke (some bytes may have landed)."""
        out: List[Optional[list]] = [None] * len(jobs)
        with self._lock:
            mgr = self._mgr
            if mgr is None:
                mgr = self._mgr = compat.transport_manager("NIXL")
                self._cache_size = compat.ray_nixl_remote_agent_cache_size()
            agent = mgr.get_nixl_agent()
            self._hook(agent)
            posted = []  # (index, object id, handle, kept key or None, Ray's request or None)
            used = set()
            try:
                for i, (obj_id, meta, targets) in enumerate(jobs):
                    if not targets:
                        out[i] = targets
                        continue
                    key = self._key(meta, targets)
                    handle = None
                    if key is not None and key not in used:
                        try:
                            handle = self._request(mgr, agent, key, meta, targets)
                        except Exception as e:  # nothing posted: Ray's read may still serve it
                            logger.debug("[RDT] no kept NIXL request for %s: %s", obj_id, e)
                    if handle is not None:
                        used.add(key)
                        posted.append((i, obj_id, handle, key, None))
                        if self._post(agent, handle, obj_id):
                            posted.pop()  # done at once (a small read)
                            out[i] = targets
                        continue
                    request = self._through_ray(mgr, obj_id, meta, targets)
                    if request is not None:
                        posted.append((i, obj_id, request.xfer_handle, None, request))
                self._wait(agent, posted, out, jobs, timeout_s)
            except BaseException:
                for _, _, _, key, _ in posted:
                    if key is not None:
                        self._drop(key)  # a request that broke or may still run is never posted again
                self.counts["failed"] += 1
                raise
        return out

    @staticmethod
    def _post(agent, handle, obj_id: str) -> bool:
        """Post a read; whether it is done already."""
        state = agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError(f"the NIXL read of object {obj_id} could not be posted "
                               "(the sender may have died)")
        return state == "DONE"

    @staticmethod
    def _wait(agent, posted, out, jobs, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 2e-5
        while posted:
            waiting = []
            for entry in posted:
                i, obj_id, handle, _, _ = entry
                state = agent.check_xfer_state(handle)
                if state == "DONE":
                    out[i] = jobs[i][2]
                elif state == "ERR":
                    raise RuntimeError(f"the NIXL read of object {obj_id} failed mid-transfer "
                                       "(the sender may have died during it)")
                else:
                    waiting.append(entry)
            posted = waiting
            if posted:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the NIXL read of {len(posted)} object(s) took more "
                                       f"than {timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        # Ray's requests (in the entries, now gone) release themselves.

    def _through_ray(self, mgr, obj_id: str, meta, targets):
        """Post one read with Ray's manager (its own request, released when
        the returned request is collected); None when it could not post."""
        self.counts["through_ray"] += 1
        try:
            return mgr.fetch_multiple_tensors(obj_id, meta, compat.nixl_communicator_metadata(), targets)
        except Exception as e:
            logger.debug("[RDT] NIXL read of %s not posted: %s", obj_id, e)
            return None

    # ------------------------------------------------------------------ #
    # Kept requests
    # ------------------------------------------------------------------ #
    def _key(self, meta, targets) -> Optional[tuple]:
        """What a kept request is made from; None when no request may be
        kept (Ray's remote-agent cache off: Ray removes the agent after
        every read)."""
        if self._cache_size <= 0:
            return None
        local = tuple((t.data_ptr(), t.nbytes) for t in targets)
        return (meta.nixl_agent_name, meta.nixl_agent_meta_version, meta.nixl_agent_meta,
                meta.nixl_serialized_descs, meta.tensor_device, targets[0].device.type, local)

    def _request(self, mgr, agent, key: tuple, meta, targets):
        """The kept request for ``key``, made now if needed; None when the
        targets are not all registered with NIXL (Ray's read registers and
        deregisters them itself)."""
        kept = self._kept.get(key)
        remote, version = meta.nixl_agent_name, meta.nixl_agent_meta_version
        if kept is not None:
            if compat.ray_nixl_remote_agents(mgr).get(remote) == version:
                self._kept.move_to_end(key)
                compat.ray_nixl_remote_agents(mgr).move_to_end(remote)
                self.counts["reused"] += 1
                return kept.handle
            self._drop(key)  # (the removal hook has normally done this already)
        if not all(compat.ray_nixl_registered(mgr, t) for t in targets):
            return None
        local_descs, remote_descs = self._descs(agent, meta, targets)
        self._load_remote(mgr, agent, remote, version, meta.nixl_agent_meta)
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, b"")
        while len(self._kept) >= self.max_kept:
            self._drop(next(iter(self._kept)))
        self._kept[key] = _Kept(handle, remote, sum(t.nbytes for t in targets))
        self.counts["made"] += 1
        return handle

    @staticmethod
    def _descs(agent, meta, targets):
        """Both descriptor lists, one descriptor per tensor, placed as Ray's
        NIXL put packs the tensors into its descriptors."""
        import math

        layout, packed_offsets, group_by_desc = compat.ray_nixl_packing()
        remote_groups = agent.deserialize_descs(meta.nixl_serialized_descs)
        group_nbytes = [remote_groups[i][1] for i in range(remote_groups.descCount())]
        layouts = [layout(math.prod(shape) * dtype.itemsize, dtype.itemsize)
                   for shape, dtype in meta.tensor_meta]
        if len(layouts) != len(targets):
            raise ValueError(f"{len(targets)} targets for {len(layouts)} tensors")
        local, remote = [], []
        for g, group in enumerate(group_by_desc(layouts, group_nbytes)):
            addr, _, dev = remote_groups[g]
            offsets, _ = packed_offsets([layouts[j] for j in group])
            for offset, j in zip(offsets, group):
                t = targets[j]
                nbytes = layouts[j].nbytes
                if t.nbytes != nbytes:
                    raise ValueError(f"target {j} has {t.nbytes} bytes, the ref's tensor {nbytes}")
                local.append((t.data_ptr(), nbytes, max(t.get_device(), 0)))
                remote.append((addr + offset, nbytes, dev))
        local_type = "cuda" if targets[0].is_cuda else "cpu"
        remote_type = "cuda" if meta.tensor_device == "cuda" else "cpu"
        return (agent.get_xfer_descs(local, mem_type=local_type),
                agent.get_xfer_descs(remote, mem_type=remote_type))

    def _load_remote(self, mgr, agent, remote: str, version: int, agent_meta: bytes) -> None:
        """Load the remote agent's metadata into the agent, keeping Ray's
        cache of remote agents as Ray's own read would."""
        cache = compat.ray_nixl_remote_agents(mgr)
        if remote in cache:
            if cache[remote] != version:  # the sender deregistered memory since
                agent.remove_remote_agent(remote)
            cache.move_to_end(remote)
        elif len(cache) >= self._cache_size:
            evicted, _ = cache.popitem(last=False)
            agent.remove_remote_agent(evicted)
        cache[remote] = version
        agent.add_remote_agent(agent_meta)

    def _drop(self, key: tuple) -> None:
        kept = self._kept.pop(key, None)
        if kept is None:
            return
        self.counts["released"] += 1
        try:
            kept.handle.release()
        except Exception as e:  # NIXL keeps a handle it cannot release; never reused
            logger.warning("[RDT] a kept NIXL transfer request could not be released: %s", e)

    def release(self, remote: Optional[str] = None) -> int:
        """Release the kept requests (of one remote agent). Returns how many."""
        with self._lock:
            keys = [k for k, v in self._kept.items() if remote is None or v.remote == remote]
            for key in keys:
                self._drop(key)
            return len(keys)

    # ------------------------------------------------------------------ #
    # What may leave a kept request dangling
    # ------------------------------------------------------------------ #
    def _hook(self, agent) -> None:
        if self._hooked_agent is agent:
            return
        reader = self

        def remove_remote_agent(name, _original=agent.remove_remote_agent):
            reader.release(name)
            return _original(name)

        def deregister_memory(*args, _original=agent.deregister_memory, **kwargs):
            reader.release()  # which requests cover it is not worth working out: rare
            return _original(*args, **kwargs)

        agent.remove_remote_agent = remove_remote_agent
        agent.deregister_memory = deregister_memory
        self._hooked_agent = agent

    def status(self) -> Dict[str, Any]:
        """Kept requests and counters (without the lock: a long read holds it)."""
        kept = list(self._kept.values())
        return {"kept": len(kept), "kept_bytes": sum(k.nbytes for k in kept), **self.counts}


_reader: Optional[NixlReader] = None
_reader_lock = threading.Lock()


def reader() -> NixlReader:
    """This process's reader (its Ray NIXL agent is one per process too)."""
    global _reader
    if _reader is None:
        with _reader_lock:
            if _reader is None:
                _reader = NixlReader()
    return _reader


def read(jobs, timeout_s: float) -> List[Optional[list]]:
    """:meth:`NixlReader.read` of this process's reader."""
    return reader().read(jobs, timeout_s)
