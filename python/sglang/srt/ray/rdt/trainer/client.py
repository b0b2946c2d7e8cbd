"""WeightSyncClient: push a trainer's weights into a running SGLang engine over RDT. One ``update()`` of a client
runs at a time (``_busy``); every name, shape and dtype is checked before any byte moves (:mod:`.update`)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.ray.rdt.defaults import CALL_TIMEOUT_S, SESSION_LEASE_S, SGLANG_IPC, bucket_bytes_for
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError
from sglang.srt.ray.rdt.ranks import gather, settle, unfinished
from sglang.srt.ray.rdt.trainer import buckets, staging
from sglang.srt.ray.rdt.trainer.discovery import (RankInfo, default_api_key, ensure_ray, find_ranks,
                                                  find_ranks_by_url, http)
from sglang.srt.ray.rdt.trainer.lane import Lanes
from sglang.srt.ray.rdt.trainer.route import Route, decide_route
from sglang.srt.ray.rdt.trainer.sender import SenderLink, release_rank_mappings
from sglang.srt.ray.rdt.trainer.sessions import make_session
from sglang.srt.ray.rdt.trainer.stats import BucketStats, UpdateStats
from sglang.srt.ray.rdt.trainer.update import Update
from sglang.srt.ray.rdt.transport import same_node, tensor_scan

__all__ = ["WeightSyncClient", "WeightSyncRankError", "UpdateStats", "BucketStats", "RankInfo"]

logger = logging.getLogger(__name__)

# Calls that go over a rank's lane when it has one: (lane op, its arguments).
_LANE_OPS: Dict[str, Tuple[str, Callable[..., Dict[str, Any]]]] = {
    "finalize_weight_update": ("finalize", lambda v=None, f=True: {"weight_version": v, "flush_cache": f}),
    "abort_weight_update": ("abort", lambda reason="aborted": {"reason": reason}),
}


class WeightSyncClient:
    """Drive RDT weight updates of one SGLang engine from a trainer (see also :meth:`connect`, :meth:`from_engine`).

    Args:
        actors: the SchedulerActor handles, in global rank order.
        names: their actor names (for error messages), if known.
        url: the engine's HTTP address; the session is ``POST /weight_sync/*``.
        engine: a ``RayEngine`` instead of ``url``. With neither, the caller must have paused generation; the
            client then finalizes or aborts each rank.
        bucket_bytes: size of each of the two bucket slots, and the bound of an iterator read in place (two
            buckets alive). Default: 1 GiB on CUDA, 256 MiB on the CPU.
        device: where the trainer's tensors (and the slots) live.
        pull_timeout_s: transfer timeout per pull on a rank (default: the engine's ``--rdt-pull-timeout``).
        lease_s: the engine aborts a session not ended within this many seconds.
        call_timeout_s: bound on every other call (register, layout, session).
        sender: ``"local"`` or None (the slots live in this process).
        transport: how ranks without a lane pull slot refs: ``"auto"``, ``"SGLANG_IPC"``, or ``"nixl"`` (every
            rank, no lanes; refused for a rank on the trainer's own GPU).
        export: ``"auto"`` (in place where the ranks can, else buckets), ``"direct"`` (in place, or fail before
            anything moves) or ``"buckets"`` (always copy, never written by this process). Tensors outside kept
            memory are written by this process into the parameters of ranks on its own device, unless ``"buckets"``.
        lane: reach ranks on this node over their call lane; False: Ray calls and slot refs only.
        api_key: the engine's ``--admin-api-key`` (else ``--api-key``); default ``$SGLANG_RDT_API_KEY``.
        staging: :meth:`staging` allocates in the staging pool (:mod:`.staging`), which ranks keep mapped.
    """

    def __init__(self, actors: Sequence[Any], *, names: Optional[Sequence[Optional[str]]] = None,
                 url: Optional[str] = None, engine: Any = None, bucket_bytes: Optional[int] = None,
                 device: str = "cpu", pull_timeout_s: Optional[float] = None, lease_s: float = SESSION_LEASE_S,
                 call_timeout_s: float = CALL_TIMEOUT_S, sender: Optional[str] = None, transport: str = "auto",
                 export: str = "auto", lane: bool = True, staging: bool = True, api_key: Optional[str] = None):
        transport = {"auto": "auto", "nixl": "nixl", "sglang_ipc": SGLANG_IPC}.get(transport.lower())
        if transport is None:
            raise ValueError("transport must be 'auto', 'nixl' or 'SGLANG_IPC'")
        if export not in ("auto", "direct", "buckets"):
            raise ValueError(f"export must be 'auto', 'direct' or 'buckets', got {export!r}")
        if not actors:
            raise WeightSyncError("no SchedulerActor handles given")
        if url is not None and engine is not None:
            raise ValueError("give url= or engine= for the update session, not both")
        names = list(names) if names is not None else [None] * len(actors)
        if len(names) != len(actors):
            raise ValueError(f"{len(names)} names for {len(actors)} actors")
        self.ranks: List[RankInfo] = [RankInfo(i, a, n) for i, (a, n) in enumerate(zip(actors, names))]
        self.labels = [r.label() for r in self.ranks]
        self.url = url.rstrip("/") if url else None
        self.device_obj = torch.device(device)
        if self.device_obj.type == "cuda" and self.device_obj.index is None:
            self.device_obj = torch.device("cuda", torch.cuda.current_device())
        self.bucket_bytes = int(bucket_bytes or bucket_bytes_for(device))
        self.pull_timeout_s = pull_timeout_s
        self.lease_s = float(lease_s)
        self.call_timeout_s = float(call_timeout_s)
        self.transport, self.export = transport, export
        self.api_key = default_api_key(api_key)
        self.session = make_session(self.url, engine, self._call_entries, self.lease_s, self.call_timeout_s,
                                    self.api_key)
        if sender not in (None, "local"):
            raise ValueError(f"sender must be 'local' (the default): the bucket slots live in the "
                             f"trainer's process; got {sender!r}")
        self.sender = SenderLink(device, self.call_timeout_s)
        self.lanes = Lanes(enabled=lane and transport != "nixl")
        self.layouts_book = buckets.LayoutBook()
        self.stuck: List[Any] = []  # flights of a failed update whose pulls never returned
        self.update_tags = itertools.count(1)  # names the slot tokens of each update
        self._staging = staging
        self._pool = None
        self._layouts: Optional[List[Dict[str, Dict[str, Any]]]] = None
        self._statuses: Optional[List[Dict[str, Any]]] = None
        self._route: Optional[Route] = None
        self._hf_resharder = None
        self._busy = threading.Lock()  # one update() of this client at a time
        tensor_scan.prepare()  # (the first use on a machine compiles it: not inside an update)

    @classmethod
    def connect(cls, port: Optional[int] = None, *, url: Optional[str] = None, api_key: Optional[str] = None,
                namespace: Optional[str] = None, node_ip: Optional[str] = None,
                host: str = "127.0.0.1", dp_size: int = 1, tp_size: int = 1, pp_size: int = 1,
                bundle_index: Union[int, Callable[[int, int, int], int]] = 0,
                address: Optional[str] = None, **kwargs) -> "WeightSyncClient":
        """A client for a running engine's ranks: named by the engine at ``url`` alone (``GET /weight_sync/ranks``),
        or found by actor names rebuilt from ``port``, ``namespace`` and layout. Raises ``ValueError`` without
        either, :class:`WeightSyncError` when Ray cannot be joined or a rank's actor is not found.

        Args:
            port, namespace: the engine's HTTP ``--port`` and ``--ray-namespace``.
            url: the engine's HTTP address (default ``http://{host}:{port}``).
            api_key: as for the constructor.
            host, node_ip: where the engine's HTTP server listens; the Ray node of rank 0 (default ``host``, or
                this node if ``host`` is a loopback/any address).
            dp_size, tp_size, pp_size: the engine's layout; ranks are ordered dp, then pp, then tp.
            bundle_index: each rank's placement-group bundle: an int or ``f(dp_rank, pp_rank, tp_rank)``.
            address: the Ray cluster to join when this process has no Ray context yet.
            **kwargs: passed to the constructor.
        """
        ensure_ray(address)
        if port is None:
            if not url:
                raise ValueError("connect() needs the engine's url= (or its port=, namespace= and layout)")
            actors, names = find_ranks_by_url(url.rstrip("/"), default_api_key(api_key),
                                              kwargs.get("call_timeout_s", CALL_TIMEOUT_S))
            return cls(actors, names=names, url=url, api_key=api_key, **kwargs)
        if namespace is None:
            raise ValueError("connect(port=...) needs the engine's namespace= (or give url= alone)")
        actors, names = find_ranks(port, namespace, node_ip=node_ip, host=host, dp_size=dp_size,
                                   tp_size=tp_size, pp_size=pp_size, bundle_index=bundle_index)
        return cls(actors, names=names, url=url or f"http://{host}:{port}", api_key=api_key, **kwargs)

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "WeightSyncClient":
        """Use an in-process ``RayEngine`` (``enable_rdt_weight_sync=True``)."""
        return cls(engine.get_scheduler_actors(), engine=engine, **kwargs)

    def gather(self, calls, phase: str, timeout_s: float) -> Dict[int, Any]:
        """Wait for ``[(rank, call)]``; one :class:`WeightSyncRankError` if any failed."""
        return gather(calls, phase, timeout_s, lambda rank: self.ranks[rank].name)

    def _call_entries(self, method: str, *args) -> List[Any]:
        """``method`` on the first rank of each TP/PP group (it acts on the whole group)."""
        statuses = self._statuses if self._statuses is not None else self.status()
        return self._call_all(method, *args, ranks=[r for r in self.ranks
                                                     if statuses[r.index].get("group_entry", True)])

    def _call_all(self, method: str, *args, ranks=None) -> List[Any]:
        ranks = self.ranks if ranks is None else ranks
        calls = []
        for r in ranks:
            link = self.lanes.link(r.index) if method in _LANE_OPS else None
            if link is not None:
                op, kwargs = _LANE_OPS[method]
                calls.append((r.index, link.send(op, kwargs(*args))))
            else:
                calls.append((r.index, getattr(r.actor, method).remote(*args)))
        out = self.gather(calls, method, self.call_timeout_s)
        return [out[r.index] for r in ranks]

    def register(self, named_tensors: Optional[Mapping[str, torch.Tensor]] = None) -> List[Dict[str, Any]]:
        """Pin every rank's parameters with NIXL, open the lanes and choose the route (idempotent); returns each
        rank's ``register_weight_for_rdt()``. ``named_tensors`` (a mapping): the tensors later updates send, checked
        and prepared on the ranks now, so the first update costs what later ones do. Raises
        :class:`WeightSyncError` (a refused key, a misfit tensor) or :class:`WeightSyncRankError`."""
        if self.url:  # a key that cannot drive updates fails here, before anything moves
            http("GET", self.url, "/weight_sync/ranks", self.api_key, self.call_timeout_s)
        out = self._call_all("register_weight_for_rdt")
        if self.device_obj.type == "cuda":
            same_node.warm(self.device_obj)  # the gathers' copy kernel, built here rather than in an update
        self.parameter_layouts(refresh=True)
        self._statuses = self._route = None
        route = self.route()
        if named_tensors is not None:
            if buckets.is_stream(named_tensors):
                raise WeightSyncError("register() takes a mapping of the tensors, not an iterator")
            plan = Update(self, None, self.bucket_bytes, False, True)
            steps = plan.plan(named_tensors)  # grouped as update() will group them: its layouts are prepared
            if plan.in_place:
                self._prepare_direct(steps, plan.rank_groups)
            elif not plan.push:
                self.sender.prepare(plan.slot_bytes, self.ranks)
        elif not route.direct:  # every update is gathered into the slots: make them now
            self.sender.prepare(self.slot_bytes_for_any_update(self.bucket_bytes) or self.bucket_bytes, self.ranks)
        # (a direct route reserves nothing here: the first update that gathers makes the slots)
        return out

    def slot_bytes_for_any_update(self, bucket_bytes: int) -> Optional[int]:
        """Slots no update of these parameters outgrows (:func:`.buckets.slot_bytes_for`); None: a dtype unknown."""
        layouts = set()  # (replicas share a layout: one rank group)
        for layout in self._layouts:
            specs = buckets.expected_specs(layout).values()
            if any(dtype is None for _, _, dtype in specs):
                return None
            layouts.add(tuple(torch.Size(shape).numel() * dtype.itemsize for shape, _, dtype in specs))
        return buckets.slot_bytes_for(list(layouts), bucket_bytes)

    def _prepare_direct(self, steps, rank_groups) -> None:
        if self.device_obj.type == "cuda":
            torch.cuda.synchronize(self.device_obj)
        calls = []
        for step in steps:
            for rg, group in step:
                meta = same_node.export(group.tensors, with_specs=False, scan=group.scan)
                calls += [(r, self.lanes.pull(r, group, meta, None, "prepare")) for r in rank_groups[rg]]
        self.gather(calls, "prepare the first update", self.call_timeout_s)
        for r, call in calls:
            self.lanes.defined(r, call)

    def parallelism_configs(self) -> List[Dict[str, Any]]:
        """Each rank's parallel layout (tp/pp/dp ranks and sizes, device, ...)."""
        return self._call_all("get_parallelism_config")

    def parameter_layouts(self, refresh: bool = False) -> List[Dict[str, Dict[str, Any]]]:
        """Each rank's ``{name: {"shape", "dtype", "data_ptr"}}`` (cached)."""
        if self._layouts is None or refresh:
            self._layouts = self._call_all("get_parameter_layout")
            for layout in self._layouts:
                buckets.expected_specs(layout)
        return self._layouts

    def status(self) -> List[Dict[str, Any]]:
        """Each rank's ``get_weight_sync_status()``."""
        self._statuses = self._call_all("get_weight_sync_status")
        return self._statuses

    def route(self) -> Route:
        """Which ranks get lane calls, whether they read in place, how slot refs are put (:mod:`.route`); cached
        until a lane breaks or :meth:`register` runs. Raises :class:`WeightSyncError` for an impossible setting."""
        if self._route is not None and all(self.lanes.link(r) for r in self._route.lanes):
            return self._route
        statuses = self._statuses if self._statuses is not None else self.status()
        self.lanes.open(self.ranks, statuses, self.call_timeout_s, self.device_obj,
                        lambda: self.staging_pool().allocating())  # (a GPU probe: in kept memory)
        lanes = {r.index for r in self.ranks if self.lanes.link(r.index) is not None}
        self._route = decide_route(self.ranks, statuses, lanes, self.transport, self.export, self.device_obj)
        return self._route

    def staging_pool(self):
        """The staging pool on the client's GPU, which also holds the slots (None on the CPU)."""
        if self._pool is None and self.device_obj.type == "cuda":
            self._pool = staging.acquire(self.device_obj)
        return self._pool

    @contextlib.contextmanager
    def staging(self):
        """``with client.staging(): tensors = build(...)``: this thread's new CUDA tensors come from the staging
        pool, which ranks read in place and keep mapped across updates (no-op on the CPU or with ``staging=False``)."""
        pool = self.staging_pool() if self._staging else None
        with pool.allocating() if pool is not None else contextlib.nullcontext():
            yield

    def update(self, named_tensors, *, version: Optional[str] = None,
               bucket_bytes: Optional[int] = None, strict: bool = False, flush_cache: bool = True,
               progress: Optional[Callable[[BucketStats, int, Optional[int]], None]] = None,
               layout: str = "rollout", hf_model_path: Optional[str] = None) -> UpdateStats:
        """Write ``named_tensors`` into every rank's live parameters and end the update; returns its stats.

        Args:
            named_tensors: ``{name: tensor}`` for every rank, ``{rank: mapping}`` (TP > 1), or an iterator of
                ``(name, tensor)`` made as it is consumed (at most two buckets alive); in the rollout layout.
            version: the new ``weight_version``.
            bucket_bytes: override the client's ``bucket_bytes`` for this update.
            strict: require every parameter of the rollout model to be sent.
            flush_cache: flush the prefix cache at the end (its KV came from the old weights).
            progress: ``progress(step_stats, done, total)`` after each step (``total`` None for an iterator).
            layout: ``"rollout"``, or ``"hf"``: one unsharded state dict under the checkpoint's names.
            hf_model_path: for ``layout="hf"``, the checkpoint directory here (default: the engine's ``--model-path``).

        Raises:
            WeightSyncError: the tensors do not fit (a mapping: nothing sent; an iterator: the session is aborted),
                the session or the sender failed, or another update of this client is running.
            WeightSyncRankError: a rank failed; the session was aborted.
        """
        if not self._busy.acquire(blocking=False):
            raise WeightSyncError("another update of this client is running")
        try:
            self._reclaim_stuck()
            if layout == "hf":
                named_tensors = buckets.normalize(named_tensors)
                adapters = {n: t for n, t in named_tensors.items() if ":" in n}  # (unsharded, to every rank)
                base = {n: t for n, t in named_tensors.items() if ":" not in n}
                per_rank = self.hf_resharder(hf_model_path).reshard(base, strict=strict) if base else {}
                named_tensors = {r: {**per_rank.get(r, {}), **adapters} for r in range(len(self.ranks))}
            elif layout != "rollout":
                raise ValueError(f"layout must be 'rollout' or 'hf', got {layout!r}")
            stats = Update(self, None if version is None else str(version), int(bucket_bytes or self.bucket_bytes),
                           strict, flush_cache, progress).run(named_tensors)
            logger.info("[RDT] update: %s", stats.summary())
            return stats
        finally:
            self._busy.release()

    def _reclaim_stuck(self) -> None:
        """Free slots a failed update left in flight, once their pulls are over."""
        for flight in list(self.stuck):
            settle(flight.calls, 1.0)
            if unfinished(flight.calls):
                raise WeightSyncError(f"a pull of a previous, failed update still reads bucket slot {flight.slot}; "
                                      "wait for it or restart the ranks before the next update")
            self.sender.call("release", flight.slot, flight.token)
            self.stuck.remove(flight)

    def register_lora_adapter(self, lora_name: str, config_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Register LoRA adapter ``lora_name`` (``config_dict``: its PEFT adapter_config) on the engine. Returns what
        :meth:`update` must send: ``expected_tensors`` (``"{lora_name}:{PEFT key}"`` -> shape) and ``dtype``."""
        if self.url:
            out = self.session.post("/register_lora_adapter", {"lora_name": lora_name, "config_dict": config_dict})
        else:
            out = self._call_entries("register_lora_adapter", lora_name, config_dict, uuid.uuid4().hex)[0]
        self.parameter_layouts(refresh=True)  # the adapter's tensors are in every rank's layout now
        return out

    def hf_resharder(self, model_path: Optional[str] = None):
        """This engine's :class:`~.hf_reshard.HFResharder`, built once (needs ``url=``)."""
        if self._hf_resharder is None:
            from sglang.srt.ray.rdt.trainer.hf_reshard import HFResharder

            if not self.url:
                raise WeightSyncError("layout='hf' reads the engine's /server_info and /parallelism_config: "
                                      "build the client with url= (or WeightSyncClient.connect)")
            self._hf_resharder = HFResharder.from_engine_url(
                self.url, len(self.ranks), model_path=model_path, timeout_s=self.call_timeout_s,
                device=str(self.device_obj), api_key=self.api_key)  # the replicas' shards are what the ranks read
        return self._hf_resharder

    def pool_bytes(self) -> int:
        """What the staging pool holds on the trainer's GPU (its tensors and the slots)."""
        return self._pool.held()[0] if self._pool is not None else 0

    def release(self) -> None:
        """Give the trainer's GPU memory back: the ranks drop their mappings, the slots and the staging pool are
        freed (the next update makes them again). Drop tensors made in ``staging()`` first."""
        self._reclaim_stuck()  # (a pull of a failed update still reading: nothing is freed, and it says so)
        try:
            if self.device_obj.type == "cuda":  # (the staging pool lives only there)
                release_rank_mappings(self.ranks, self.call_timeout_s, "the trainer's tensors")
        finally:
            try:
                self.sender.close(self.ranks)
            finally:
                staging.release(self._pool)
                self._pool = None

    def close(self) -> None:
        """Close the lanes and :meth:`release` everything."""
        self.lanes.close()
        self.release()

    def __enter__(self) -> "WeightSyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
