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
dangling are released — a request in flight once its read is done with it
(the caller waits for that). Within one read, every request is made before
any is posted, so the reader's own loading of a remote agent never releases
a request in flight (a job whose request that released is read in a next
round). A request that failed or timed out is dropped; one that cannot be
posted (stale) is dropped with its remote agent's others, and its job read
through Ray's manager.

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

# A kept request's states. IDLE: in the cache, not in use. ACQUIRED: taken by
# a read that has not posted it yet (a removal may still release it: the read
# then takes that job in its next round). BUSY: posted (or about to be) by a
# read; a removal from another thread waits until the read is done with it.
IDLE, ACQUIRED, BUSY = "idle", "acquired", "busy"


class _Kept:
    __slots__ = ("key", "handle", "remote", "nbytes", "state", "dead")

    def __init__(self, key: tuple, handle, remote: str, nbytes: int):
        self.key = key
        self.handle = handle
        self.remote = remote
        self.nbytes = nbytes
        self.state = IDLE
        self.dead = False  # released, or to be released once its read is done


class NixlReader:
    """Reads RDT NIXL objects into their targets through this process's Ray NIXL agent.

    Locks: ``_read_lock`` makes reads one at a time; ``_lock`` guards the
    kept requests and their states and is held only for bookkeeping and
    NIXL's own (non-blocking) calls — never while waiting for a transfer or
    calling into Ray's manager, whose lock the wrapped agent methods may be
    called under."""

    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept = max_kept
        self._read_lock = threading.Lock()
        self._lock = threading.RLock()
        self._done_with = threading.Condition(self._lock)  # a BUSY request became IDLE
        self._busy_thread: Optional[int] = None  # the thread whose read holds BUSY requests
        self._zombies: List[_Kept] = []  # forgotten while still in flight: released later
        self._busy: List[_Kept] = []  # the requests of the round being run
        self._taken: List[_Kept] = []  # every request the read in progress took
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

        ``jobs``: ``[(object id, NIXL transport metadata, targets)]``.
        Returns, per job, the targets, or None for a read that failed before
        anything was posted (nothing written: ``ray.get`` can still fetch it,
        or say why not). Raises ``TimeoutError`` after ``timeout_s`` and
        ``RuntimeError`` when a posted read broke (some bytes may have landed).

        Jobs with a kept (or new) request are posted together and waited for
        together, in rounds: all requests of a round are made before any is
        posted, so loading a remote agent's newer metadata (which releases
        the requests made against the older one) never pulls the ground from
        under a posted read; a job whose request that released waits for the
        next round. The rest go through Ray's manager at the end."""
        out: List[Optional[list]] = [None] * len(jobs)
        deadline = time.monotonic() + timeout_s
        with self._read_lock:
            with self._lock:
                mgr = self._mgr
                if mgr is None:
                    mgr = self._mgr = compat.transport_manager("NIXL")
                    self._cache_size = compat.ray_nixl_remote_agent_cache_size()
                agent = mgr.get_nixl_agent()
                self._hook(agent)
                self._release_zombies(agent)
            pending = []
            for i, (_, _, targets) in enumerate(jobs):
                if targets:
                    pending.append(i)
                else:
                    out[i] = targets
            through_ray: List[int] = []
            try:
                while pending:
                    batch, pending, to_ray = self._acquire(mgr, agent, jobs, pending)
                    through_ray += to_ray
                    if batch:
                        through_ray += self._run(agent, jobs, batch, out, deadline, timeout_s)
                if through_ray:
                    self._read_through_ray(mgr, agent, jobs, sorted(through_ray), out, deadline,
                                           timeout_s)
            except BaseException:
                self.counts["failed"] += 1
                raise
            finally:
                self._settle(agent)
        return out

    def _settle(self, agent) -> None:
        """After a read, whatever happened: no request stays taken by it (an
        exception between a round's making and its run would otherwise leave
        requests BUSY, and every later removal waiting for them)."""
        with self._lock:
            stuck = [e for e in self._taken if e.state != IDLE]
            self._taken = []
            self._end_round(agent, stuck, broken=True)

    def _end_round(self, agent, entries: List[_Kept], broken: bool) -> None:
        """The requests a round used go back to IDLE (``broken``: out of the
        cache too — a request that broke, or may still run, is never posted
        again); those taken out meanwhile are released; a removal waiting for
        them goes on (under _lock)."""
        for entry in entries:
            if broken:
                self._forget(entry)
            entry.state = IDLE
        self._finish(agent, [e for e in entries if e.dead])
        self._busy, self._busy_thread = [], None
        self._done_with.notify_all()

    def _acquire(self, mgr, agent, jobs, pending):
        """One round's requests: ``(batch, deferred, through_ray)``. Every
        request of the batch is BUSY on return (no removal can release it
        before its read is done)."""
        acquired: List[Tuple[int, _Kept]] = []
        deferred, to_ray = [], []
        with self._lock:
            keys = set()
            for i in pending:
                obj_id, meta, targets = jobs[i]
                try:
                    key = self._key(meta, targets)
                    if key in keys:  # the same request twice in one round
                        deferred.append(i)
                        continue
                    entry = None if key is None else self._request(mgr, agent, key, meta, targets)
                except Exception as e:  # nothing posted: Ray's read may still serve it
                    logger.debug("[RDT] no kept NIXL request for %s: %s", obj_id, e)
                    entry = None
                if entry is None:
                    to_ray.append(i)
                    continue
                keys.add(key)
                entry.state = ACQUIRED
                self._taken.append(entry)
                acquired.append((i, entry))
            batch = []
            for i, entry in acquired:
                if entry.dead:  # released while this round made its other requests
                    deferred.append(i)
                else:
                    entry.state = BUSY
                    batch.append((i, entry))
            self._busy = [e for _, e in batch]
            if batch:
                self._busy_thread = threading.get_ident()
        if not batch and not to_ray and deferred:
            # Cannot happen (the last request a round makes is never released
            # by that round); never loop on it.
            to_ray, deferred = deferred, []
        return batch, deferred, to_ray

    def _run(self, agent, jobs, batch, out, deadline: float, timeout_s: float) -> List[int]:
        """Post the batch's requests and wait for them. Returns the jobs whose
        request could not be posted (for Ray's manager)."""
        failed_post: List[int] = []
        waiting = []
        # (an exception leaves the round's requests to read()'s _settle)
        for i, entry in batch:
            try:
                state = agent.transfer(entry.handle)
            except Exception as e:  # NIXL raises on an error status
                state, why = "ERR", e
            else:
                why = None
            if state == "ERR":
                # Nothing was posted: the request (and the others made
                # against this remote agent) may be stale. Ray's read
                # serves the job, or fails it with Ray's own error.
                logger.info("[RDT] a kept NIXL read of object %s could not be posted (%s); "
                            "reading it through Ray's NIXL manager", jobs[i][0], why)
                self._forget_remote(entry)
                failed_post.append(i)
            elif state == "DONE":
                out[i] = jobs[i][2]
            else:
                waiting.append((i, entry))
        self._wait(agent, waiting, jobs, out, deadline, timeout_s, lambda e: e.handle,
                   on_error=self._forget_remote)
        with self._lock:
            self._end_round(agent, [e for _, e in batch], broken=False)
        return failed_post

    def _finish(self, agent, dead: List[_Kept]) -> None:
        """Release requests taken out of the cache while a read used them;
        one still in flight (a read that timed out, or broke beside it) is
        kept aside until it is not (releasing it would cancel it half-way)."""
        for entry in dead:
            if entry.handle is None:
                continue
            try:
                running = agent.check_xfer_state(entry.handle) == "PROC"
            except Exception:
                running = False
            if running:
                self._zombies.append(entry)
            else:
                self._release(entry)

    def _release_zombies(self, agent) -> None:
        if self._zombies:
            zombies, self._zombies = self._zombies, []
            self._finish(agent, zombies)

    def _read_through_ray(self, mgr, agent, jobs, idx, out, deadline: float, timeout_s: float) -> None:
        """Post reads with Ray's manager (its own requests, released when
        collected) and wait for them; a read Ray could not post stays None."""
        posted = []
        comm = compat.nixl_communicator_metadata()
        for i in idx:
            obj_id, meta, targets = jobs[i]
            self.counts["through_ray"] += 1
            try:
                request = mgr.fetch_multiple_tensors(obj_id, meta, comm, targets)
            except Exception as e:
                logger.debug("[RDT] NIXL read of %s not posted: %s", obj_id, e)
                continue
            posted.append((i, request))
        self._wait(agent, posted, jobs, out, deadline, timeout_s, lambda r: r.xfer_handle)

    @staticmethod
    def _wait(agent, waiting, jobs, out, deadline: float, timeout_s: float, handle_of,
              on_error=None) -> None:
        """Wait for posted reads ``[(job index, request)]``, polling finely
        (20 us, doubling to 1 ms: a small read is done in tens of us)."""
        pause = 2e-5
        while waiting:
            still = []
            for i, request in waiting:
                try:
                    state = agent.check_xfer_state(handle_of(request))
                except Exception:  # NIXL raises on an error status
                    state = "ERR"
                if state == "DONE":
                    out[i] = jobs[i][2]
                elif state == "ERR":
                    if on_error is not None:
                        on_error(request)
                    raise RuntimeError(f"the NIXL read of object {jobs[i][0]} failed "
                                       "mid-transfer (the sender may have died during it)")
                else:
                    still.append((i, request))
            waiting = still
            if waiting:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the NIXL read of {len(waiting)} object(s) took more "
                                       f"than {timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    # ------------------------------------------------------------------ #
    # Kept requests (under _lock)
    # ------------------------------------------------------------------ #
    def _key(self, meta, targets) -> Optional[tuple]:
        """What a kept request is made from; None when no request may be
        kept (Ray's remote-agent cache off: Ray removes the agent after
        every read). The element sizes place the tensors in the sender's
        descriptors (each starts at a multiple of its own)."""
        if self._cache_size <= 0:
            return None
        local = tuple((t.data_ptr(), t.nbytes) for t in targets)
        sizes = tuple(dtype.itemsize for _, dtype in meta.tensor_meta)
        return (meta.nixl_agent_name, meta.nixl_agent_meta_version, meta.nixl_agent_meta,
                meta.nixl_serialized_descs, sizes, meta.tensor_device, targets[0].is_cuda, local)

    def _request(self, mgr, agent, key: tuple, meta, targets) -> Optional[_Kept]:
        """The kept request for ``key``, made now if needed; None when the
        targets are not all registered with NIXL (Ray's read registers and
        deregisters them itself)."""
        kept = self._kept.get(key)
        remote, version = meta.nixl_agent_name, meta.nixl_agent_meta_version
        cache = compat.ray_nixl_remote_agents(mgr)
        if kept is not None:
            if cache.get(remote) == version:
                self._kept.move_to_end(key)
                cache.move_to_end(remote)
                self.counts["reused"] += 1
                return kept
            self._forget(kept)  # (the removal hook has normally done this already)
        if not all(compat.ray_nixl_registered(mgr, t) for t in targets):
            return None
        local_descs, remote_descs = self._descs(agent, meta, targets)
        self._load_remote(mgr, agent, remote, version, meta.nixl_agent_meta)
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote, b"")
        entry = _Kept(key, handle, remote, sum(t.nbytes for t in targets))
        for old_key in [k for k, e in self._kept.items() if e.state == IDLE][
                : max(0, len(self._kept) + 1 - self.max_kept)]:
            self._forget(self._kept[old_key])  # least recently used first; none in use
        self._kept[key] = entry
        self.counts["made"] += 1
        return entry

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

    def _forget_remote(self, entry: _Kept) -> None:
        with self._lock:
            self._forget(entry, remote=True)

    def _forget(self, entry: _Kept, remote: bool = False) -> None:
        """Take ``entry`` (with ``remote``: every request of its remote
        agent) out of the cache; released now unless a read is using it (then
        once that read is done with it)."""
        entries = [entry]
        if remote:
            entries += [e for e in self._kept.values() if e.remote == entry.remote and e is not entry]
        for e in entries:
            if self._kept.get(e.key) is e:
                del self._kept[e.key]
            if not e.dead:
                e.dead = True
                if e.state != BUSY:
                    self._release(e)

    def _release(self, entry: _Kept) -> None:
        if entry.handle is None:
            return
        handle, entry.handle = entry.handle, None
        self.counts["released"] += 1
        try:
            handle.release()
        except Exception as e:  # NIXL keeps a handle it cannot release; never reused
            logger.warning("[RDT] a kept NIXL transfer request could not be released: %s", e)

    def release(self, remote: Optional[str] = None) -> int:
        """Release the kept requests (of one remote agent). A request a read
        on another thread is using is released once that read is done with
        it: this waits for it (and takes out what that read made meanwhile).
        On the reading thread itself (a finalizer run mid-read deregistering
        some other memory) it cannot wait: its requests are released when its
        read is done with them. Returns how many were taken out of the cache."""
        n = 0
        with self._lock:
            while True:
                entries = [e for e in self._kept.values() if remote is None or e.remote == remote]
                for e in entries:
                    self._forget(e)
                n += len(entries)
                busy = [e for e in self._in_use() if remote is None or e.remote == remote]
                if not busy or self._busy_thread == threading.get_ident():
                    return n
                self._done_with.wait()

    def _in_use(self) -> List[_Kept]:
        """Requests a read holds BUSY (taken out of the cache or not)."""
        return [e for e in self._busy if e.state == BUSY]

    # ------------------------------------------------------------------ #
    # What may leave a kept request dangling
    # ------------------------------------------------------------------ #
    def _hook(self, agent) -> None:
        if self._hooked_agent is agent:
            return
        if self._hooked_agent is not None:
            self._kept.clear()  # made on another agent: never posted on this one
        reader = self

        # The lock is held from the release to the end of the original call:
        # no read can make a request on what is being removed in between.
        def remove_remote_agent(name, _original=agent.remove_remote_agent):
            with reader._lock:
                reader.release(name)
                return _original(name)

        def deregister_memory(*args, _original=agent.deregister_memory, **kwargs):
            with reader._lock:
                reader.release()  # which requests cover it is not worth working out: rare
                return _original(*args, **kwargs)

        agent.remove_remote_agent = remove_remote_agent
        agent.deregister_memory = deregister_memory
        self._hooked_agent = agent

    def status(self) -> Dict[str, Any]:
        """Kept requests and counters (without the lock: a long read may hold it)."""
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
