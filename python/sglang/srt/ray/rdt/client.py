"""Push new weights from a trainer into a running SGLang engine over RDT, in one call.

:class:`WeightSyncClient` is what a trainer (plain PyTorch, FSDP, verl,
OpenRLHF, miles, ...) uses from any Ray job. It drives the SchedulerActor API
(``register_weight_for_rdt``, ``get_parameter_layout``, ``pull_weights``, ...)
and the engine's update session (``/weight_sync/*`` or ``RayEngine``), so the
caller only hands over tensors::

    import ray, torch
    from sglang.srt.ray.rdt.client import WeightSyncClient

    ray.init(address="10.0.0.5:6379")            # RAY_AUTH_MODE=token in the env
    client = WeightSyncClient.connect(
        port=30000,                   # the engine's --port
        namespace="rollout",          # the engine's --ray-namespace
        host="10.0.0.5",              # its HTTP host = node of its rank 0
        dp_size=2,                    # the engine's layout
    )
    client.register()                 # pin the engine's parameters with NIXL, once
    for step in range(num_steps):
        train_one_step(model)
        stats = client.update(model.state_dict(), version=f"step-{step}")
        print(stats.summary())        # "12 tensors, 1.1 GiB to 2 ranks in 5 buckets ..."
    client.close()

An update

1. checks every name, shape and dtype against each rank's live parameters
   (``get_parameter_layout()``); a bad update raises :class:`WeightSyncError`
   before any byte moves or serving pauses;
2. packs the tensors into buckets inside a trainer-side Ray actor
   (:class:`~sglang.srt.ray.rdt.sender.BucketSender`) whose two bucket buffers
   stay allocated and NIXL-registered across updates;
3. opens the engine's update session (drains in-flight requests, holds new
   ones), then, bucket by bucket, has **every rank pull concurrently** while
   the next bucket is filled into the other buffer (double buffering). A
   buffer is written again only after every rank's pull of it returned — the
   sender refuses otherwise;
4. ends the session with the new ``weight_version`` (post-load processing,
   cache flush; serving resumes), and returns :class:`UpdateStats`.

Any failure aborts the session. A failure on a rank raises one
:class:`WeightSyncRankError` that names the rank (index, actor name, phase) and
carries the rank's own exception.

Tensors must already be in the rollout layout: the rollout model's parameter
names, dtypes and shapes. With TP 1 (any DP) pass one mapping; with TP > 1 pass
``{rank: mapping}`` (rank = the engine's global rank, the order of
:attr:`WeightSyncClient.ranks`), reusing the same mapping object for ranks that
take the same tensors (DP replicas of one TP shard) so they share buckets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.ray.actor_naming import get_scheduler_actor_name
from sglang.srt.ray.rdt.buckets import (
    Step,
    TensorItem,
    check_tensors,
    describe_bytes,
    dtype_name,
    group_ranks,
    plan_steps,
)
from sglang.srt.ray.rdt.errors import (
    WeightSyncError,
    WeightSyncRankError,
    WeightSyncSessionError,
    describe,
    unwrap,
)
from sglang.srt.ray.rdt.ranks import gather
from sglang.srt.ray.rdt.session import DEFAULT_LEASE_S
from sglang.srt.ray.rdt.sender import NUM_SLOTS, sender_actor_class

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20  # CPU buckets
# GPU buckets: every bucket costs a few ms of fixed overhead (fill, put, the
# rank's call); on 2xH200 1 GiB buckets ran 3x faster than 256 MiB ones
# (docs/performance.md). The sender keeps two slots of this size.
DEFAULT_GPU_BUCKET_BYTES = 1 << 30


def default_bucket_bytes(device: str) -> int:
    return DEFAULT_GPU_BUCKET_BYTES if str(device).startswith("cuda") else DEFAULT_BUCKET_BYTES


DEFAULT_CALL_TIMEOUT_S = 120.0
# A rank runs a pull at its scheduler's next safe point (up to 120 s away)
# and then bounds the transfer itself (its --rdt-pull-timeout, 60 s default).
DEFAULT_PULL_TIMEOUT_S = 60.0
PULL_WAIT_MARGIN_S = 150.0

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]
Progress = Callable[["BucketStats", int, int], None]


# --------------------------------------------------------------------------- #
# Stats
# --------------------------------------------------------------------------- #
@dataclass
class BucketStats:
    """One bucket (one step: bucket k of every rank group) of an update."""

    index: int
    tensors: int
    bytes: int
    ranks: int
    fill_seconds: float
    pull_seconds: float  # slowest rank's own pull time (plan + transfer)
    gbps: float  # bytes / pull_seconds
    rank_seconds: List[float] = field(default_factory=list)


@dataclass
class UpdateStats:
    """What :meth:`WeightSyncClient.update` did.

    ``bytes`` is the payload (what the trainer sent, once per distinct rank
    group); ``bytes_moved`` counts every rank's copy. ``seconds`` is the whole
    call; ``transfer_seconds`` from the first bucket fill to the last pull's
    return; ``gbps`` = ``bytes`` / ``transfer_seconds``.
    """

    version: Optional[str]
    tensors: int
    bytes: int
    bytes_moved: int
    ranks: int
    buckets: List[BucketStats]
    seconds: float
    transfer_seconds: float
    begin_seconds: float
    end_seconds: float
    gbps: float
    transport: str = "nixl"  # the path(s) the ranks' pulls took

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"{self.tensors} tensors, {describe_bytes(self.bytes)} to {self.ranks} "
            f"rank{'s' if self.ranks != 1 else ''} in {len(self.buckets)} bucket"
            f"{'s' if len(self.buckets) != 1 else ''}: transfer {self.transfer_seconds:.3f} s "
            f"({self.gbps:.3f} GB/s), update {self.seconds:.3f} s, "
            f"transport={self.transport}, weight_version={self.version}"
        )


@dataclass(frozen=True)
class RankInfo:
    """One engine rank as the client addresses it."""

    index: int
    actor: Any
    name: Optional[str] = None

    def label(self) -> str:
        return f"rank {self.index}" + (f" ({self.name})" if self.name else "")


@dataclass
class _Flight:
    """A filled bucket slot and the pulls reading it."""

    step: Step
    slot: int
    token: str
    refs: List[Any]
    fill_seconds: float
    pulls: List[Tuple[int, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- #
# The client
# --------------------------------------------------------------------------- #
class WeightSyncClient:
    """Drive RDT weight updates of one SGLang engine from a trainer.

    Build it with :meth:`connect` (rebuild the engine's actor names from its
    port, namespace and layout — any Ray job of the cluster), :meth:`from_engine`
    (an in-process ``RayEngine``) or the constructor (actor handles, e.g. from
    ``launch_engine``, plus ``url=`` or ``engine=`` for the update session).

    Args:
        actors: the SchedulerActor handles, in global rank order.
        names: their actor names (for error messages), if known.
        url: the engine's HTTP address (``http://host:port``): the session is
            ``POST /weight_sync/{begin,end,abort}``.
        engine: a ``RayEngine`` (or anything with ``begin_weight_sync``,
            ``end_weight_sync``, ``abort_weight_sync``) for the session instead.
            With neither, the caller must have paused generation
            (``/pause_generation``): ranks refuse pulls otherwise; the client
            then finalizes (``finalize_weight_update``) or aborts each rank itself.
        bucket_bytes: bucket size; the sender keeps two buffers of (about) this
            size, sized down to the model when it is smaller. Default: 1 GiB for
            CUDA buckets, 256 MiB for CPU ones.
        device: where the bucket buffers live (``"cpu"``, ``"cuda"``).
        pull_timeout_s: transfer timeout per pull on a rank (default: the
            engine's ``--rdt-pull-timeout``).
        lease_s: the engine aborts a session not ended within this many seconds.
        call_timeout_s: bound on every other call (register, layout, session).
        sender: an existing ``BucketSender`` actor handle to use, or
            ``"local"``: keep the buckets in this process (which must be a Ray
            actor or driver that may ``ray.put`` with a tensor transport) —
            the fast choice for GPU trainers, whose tensors then never leave
            the GPU (with the default sender actor they are pickled to it).
        sender_options: Ray ``.options()`` for the sender actor the client
            creates (default: ``num_cpus=0``; e.g. ``num_gpus=1`` for CUDA buckets).
        transport: how buckets are put: ``"auto"`` (default: ``"SGLANG_IPC"``
            when every rank accepts it, else ``"nixl"``), ``"SGLANG_IPC"`` (the
            same-node fast path; its refs carry NIXL metadata too, so each rank
            picks: CUDA IPC or process_vm_readv on the trainer's node, NIXL
            elsewhere) or ``"nixl"``. Each pull reports the path it took
            (``UpdateStats.transport``).
    """

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        names: Optional[Sequence[Optional[str]]] = None,
        url: Optional[str] = None,
        engine: Any = None,
        bucket_bytes: Optional[int] = None,
        device: str = "cpu",
        pull_timeout_s: Optional[float] = None,
        lease_s: float = DEFAULT_LEASE_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        sender: Any = None,
        sender_options: Optional[Dict[str, Any]] = None,
        transport: str = "auto",
    ):
        if transport.lower() not in ("auto", "nixl", "sglang_ipc"):
            raise ValueError(f"transport must be 'auto', 'nixl' or 'SGLANG_IPC', got {transport!r}")
        if not actors:
            raise WeightSyncError("no SchedulerActor handles given")
        if url is not None and engine is not None:
            raise ValueError("give url= or engine= for the update session, not both")
        names = list(names) if names is not None else [None] * len(actors)
        if len(names) != len(actors):
            raise ValueError(f"{len(names)} names for {len(actors)} actors")
        self.ranks: List[RankInfo] = [
            RankInfo(i, a, n) for i, (a, n) in enumerate(zip(actors, names))
        ]
        self.url = url.rstrip("/") if url else None
        self.engine = engine
        self.bucket_bytes = int(bucket_bytes or default_bucket_bytes(device))
        self.device = device
        self.pull_timeout_s = pull_timeout_s
        self.lease_s = float(lease_s)
        self.call_timeout_s = float(call_timeout_s)
        self._own_sender = sender is None or isinstance(sender, str)
        if isinstance(sender, str):
            if sender != "local":
                raise ValueError(f"sender must be an actor handle or 'local', got {sender!r}")
            sender = None
            self._local_sender = True
        else:
            self._local_sender = False
        self._sender = sender
        self._sender_options = dict(sender_options or {})
        self._sender_bytes = 0
        self._layouts: Optional[List[Dict[str, Dict[str, Any]]]] = None
        self._stuck: Dict[int, _Flight] = {}
        self._busy = threading.Lock()
        self.updates = 0
        self.transport = transport.lower() if transport.lower() != "sglang_ipc" else "SGLANG_IPC"

    # ------------------------------------------------------------------ #
    # Construction
    # ------------------------------------------------------------------ #
    @classmethod
    def connect(
        cls,
        port: int,
        *,
        namespace: str,
        node_ip: Optional[str] = None,
        host: str = "127.0.0.1",
        dp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        bundle_index: Union[int, Callable[[int, int, int], int]] = 0,
        address: Optional[str] = None,
        url: Optional[str] = None,
        **kwargs,
    ) -> "WeightSyncClient":
        """Find a running engine's ranks by their rebuilt actor names.

        Args:
            port: the engine's HTTP ``--port`` (part of every actor name).
            namespace: the engine's ``--ray-namespace``.
            node_ip: the node of the engine's rank 0, as Ray names it; default:
                ``host`` unless it is a loopback/any address, else this node.
            host: where the engine's HTTP server listens (the session URL).
            dp_size, tp_size, pp_size: the engine's layout; ranks are ordered
                dp, then pp, then tp (the engine's global rank).
            bundle_index: the placement-group bundle of each rank: an int, or
                ``f(dp_rank, pp_rank, tp_rank)``; 0 for a single-node engine.
            address: Ray cluster to connect to when this process has no Ray
                context yet (with ``RAY_AUTH_MODE=token`` for token-auth heads).
            url: the session URL, if not ``http://{host}:{port}``.
            **kwargs: passed to the constructor (``bucket_bytes``, ``device``, ...).
        """
        import ray

        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            if not address:
                raise WeightSyncError(
                    "this process is not connected to Ray: call ray.init(address=...) "
                    "first, or pass address= / set RAY_ADDRESS (and RAY_AUTH_MODE=token "
                    "for a head started with `ray start`)"
                )
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        if node_ip is None:
            node_ip = (
                host if host not in ("127.0.0.1", "localhost", "0.0.0.0", "::1", "")
                else ray.util.get_node_ip_address()
            )
        actors, names = [], []
        for dp in range(dp_size):
            for pp in range(pp_size):
                for tp in range(tp_size):
                    bundle = bundle_index(dp, pp, tp) if callable(bundle_index) else bundle_index
                    name = get_scheduler_actor_name(
                        rank0_node_ip=node_ip, dp_rank=dp, pp_rank=pp, tp_rank=tp,
                        port=port, bundle_idx=bundle,
                    )
                    try:
                        actors.append(ray.get_actor(name, namespace=namespace))
                    except ValueError:
                        raise WeightSyncError(_not_found(name, namespace, port)) from None
                    names.append(name)
        logger.info(
            "[RDT] weight-sync client: %d ranks of the engine on port %d in namespace %r",
            len(actors), port, namespace,
        )
        return cls(actors, names=names, url=url or f"http://{host}:{port}", **kwargs)

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "WeightSyncClient":
        """Use an in-process ``RayEngine`` (``enable_rdt_weight_sync=True``)."""
        return cls(engine.get_scheduler_actors(), engine=engine, **kwargs)

    # ------------------------------------------------------------------ #
    # Calls on every rank
    # ------------------------------------------------------------------ #
    def _gather(self, calls: Sequence[Tuple[int, Any]], phase: str, timeout_s: float) -> Dict[int, Any]:
        """Wait for ``[(rank, ref)]``; one :class:`WeightSyncRankError` if any failed."""
        return gather(calls, phase, timeout_s, lambda rank: self.ranks[rank].name)

    def _call_all(self, method: str, *args, timeout_s: Optional[float] = None) -> List[Any]:
        calls = [(r.index, getattr(r.actor, method).remote(*args)) for r in self.ranks]
        out = self._gather(calls, method, timeout_s or self.call_timeout_s)
        return [out[r.index] for r in self.ranks]

    def register(self) -> List[Dict[str, Any]]:
        """Pin every rank's parameters with NIXL once and prepare the bucket buffers.

        Idempotent. Returns each rank's ``register_weight_for_rdt()`` result
        (``{"registered": False, "reason": ...}`` under ``--enable-memory-saver``,
        where pulls register per call instead).
        """
        out = self._call_all("register_weight_for_rdt")
        layouts = self.parameter_layouts(refresh=True)
        items = [_item(n, spec["shape"], spec["dtype"]) for n, spec in layouts[0].items()]
        if items:
            _, buffer_bytes = plan_steps([items], self.bucket_bytes)
            self._prepare_sender(buffer_bytes)
        return out

    def parallelism_configs(self) -> List[Dict[str, Any]]:
        """Each rank's parallel layout (tp/pp/dp ranks and sizes, device, ...)."""
        return self._call_all("get_parallelism_config")

    def parameter_layouts(self, refresh: bool = False) -> List[Dict[str, Dict[str, Any]]]:
        """Each rank's ``{name: {"shape", "dtype", "data_ptr"}}`` (cached)."""
        if self._layouts is None or refresh:
            self._layouts = self._call_all("get_parameter_layout")
        return self._layouts

    def status(self) -> List[Dict[str, Any]]:
        """Each rank's ``get_weight_sync_status()``."""
        return self._call_all("get_weight_sync_status")

    # ------------------------------------------------------------------ #
    # The sender
    # ------------------------------------------------------------------ #
    def put_transport(self) -> str:
        """The transport the client's sender puts with (``auto`` resolved
        against what every rank accepts)."""
        if self.transport == "auto":
            accepted = [set(st.get("transports") or ["NIXL"]) for st in self.status()]
            both = all("SGLANG_IPC" in a for a in accepted)
            self.transport = "SGLANG_IPC" if both else "nixl"
        return self.transport

    def _sender_handle(self):
        if self._sender is None and self._local_sender:
            from sglang.srt.ray.rdt.sender import BucketSender

            self._sender = BucketSender(self.device, NUM_SLOTS, transport=self.put_transport())
        if self._sender is None:
            options = {"num_cpus": 0, **self._sender_options}
            if self.device.startswith("cuda"):
                options.setdefault("num_gpus", 1)
            self._sender = sender_actor_class().options(**options).remote(
                self.device, NUM_SLOTS, transport=self.put_transport()
            )
        return self._sender

    def _sender_call(self, method: str, *args):
        import ray

        sender = self._sender_handle()
        try:
            if self._local_sender:
                return getattr(sender, method)(*args)
            return ray.get(getattr(sender, method).remote(*args), timeout=self.call_timeout_s)
        except Exception as e:
            cause = unwrap(e)
            raise WeightSyncError(
                f"the bucket sender failed in {method}: {describe(cause)}"
            ) from cause

    def _prepare_sender(self, buffer_bytes: int) -> None:
        self._reclaim_stuck()
        if buffer_bytes > self._sender_bytes:
            if self._sender_bytes:
                self._release_rank_mappings()  # the old slots are about to be freed
            state = self._sender_call("prepare", buffer_bytes)
            self._sender_bytes = state["slot_bytes"]

    def _release_rank_mappings(self) -> None:
        """Make every rank close its cached CUDA IPC mappings of the sender's
        slots before they are freed (the slots are declared persistent, so
        ranks keep those mappings between updates). Best effort per rank."""
        import ray

        if not self.device.startswith("cuda") or self._sender is None:
            return
        try:
            token = self._sender_call("ipc_sender_token")
        except Exception as e:
            logger.debug("[RDT] sender has no IPC identity: %s", e)
            return
        if token is None:
            return
        calls = []
        for r in self.ranks:
            try:
                calls.append((r, r.actor.release_weight_sync_mappings.remote(token)))
            except AttributeError:  # an actor without the method (older engine)
                pass
        for r, ref in calls:
            try:
                ray.get(ref, timeout=self.call_timeout_s)
            except Exception as e:
                logger.warning("[RDT] %s did not release its mappings of the buckets: %s",
                               r.label(), describe(unwrap(e)))

    def _reclaim_stuck(self) -> None:
        """Free slots a failed update left in flight, once their pulls are over."""
        import ray

        for slot, flight in list(self._stuck.items()):
            refs = [ref for _, ref in flight.pulls]
            _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=1.0) if refs else ([], [])
            if not_ready:
                raise WeightSyncError(
                    f"a pull of a previous, failed update still reads bucket slot {slot} "
                    f"({len(not_ready)} rank(s) have not returned); wait for them or "
                    "restart the ranks before the next update"
                )
            self._sender_call("release", slot, flight.token)
            del self._stuck[slot]

    # ------------------------------------------------------------------ #
    # The update session
    # ------------------------------------------------------------------ #
    def _http(self, path: str, body: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
        import requests

        try:
            r = requests.post(f"{self.url}{path}", json=body, timeout=timeout_s)
        except requests.RequestException as e:
            raise WeightSyncSessionError(f"POST {self.url}{path} failed: {e}") from e
        try:
            data = r.json()
        except ValueError:
            data = {"success": False, "message": r.text[:500]}
        if r.status_code != 200 or not data.get("success", False):
            raise WeightSyncSessionError(
                f"POST {self.url}{path} -> HTTP {r.status_code}: {data.get('message', data)}"
            )
        return data

    def _begin(self) -> Optional[str]:
        if self.url:
            data = self._http(
                "/weight_sync/begin", {"lease_s": self.lease_s}, self.call_timeout_s + 30
            )
            return data["session_id"]
        if self.engine is not None:
            try:
                return self.engine.begin_weight_sync(lease_s=self.lease_s).get("session_id")
            except Exception as e:
                raise WeightSyncSessionError(f"begin_weight_sync failed: {e}") from e
        return None  # the caller paused generation

    def _end(self, session_id: Optional[str], version: Optional[str], flush_cache: bool):
        if self.url:
            return self._http(
                "/weight_sync/end",
                {"weight_version": version, "flush_cache": flush_cache, "session_id": session_id},
                self.call_timeout_s + 30,
            )
        if self.engine is not None:
            try:
                return self.engine.end_weight_sync(weight_version=version, flush_cache=flush_cache)
            except Exception as e:
                raise WeightSyncSessionError(f"end_weight_sync failed: {e}") from e
        return self._call_all("finalize_weight_update", version, flush_cache)

    def _abort(self, session_id: Optional[str], reason: str) -> None:
        if self.url:
            self._http(
                "/weight_sync/abort", {"reason": reason, "session_id": session_id},
                self.call_timeout_s + 30,
            )
        elif self.engine is not None:
            self.engine.abort_weight_sync(reason)
        else:
            # Best effort on every rank: a dead rank must not keep the live
            # ones from closing their session.
            try:
                self._call_all("abort_weight_update", reason)
            except WeightSyncRankError as e:
                logger.error("[RDT] abort did not reach every rank: %s", e)

    # ------------------------------------------------------------------ #
    # Update
    # ------------------------------------------------------------------ #
    def _payloads(self, named_tensors) -> Tuple[List[Dict[str, torch.Tensor]], List[List[int]]]:
        """Per-rank ``{name: tensor}`` and the groups of ranks sharing one."""
        n = len(self.ranks)
        if isinstance(named_tensors, Mapping) and named_tensors and all(
            isinstance(k, int) for k in named_tensors
        ):
            missing = [r for r in range(n) if r not in named_tensors]
            extra = [k for k in named_tensors if not 0 <= k < n]
            if missing or extra:
                raise WeightSyncError(
                    f"a per-rank update needs tensors for ranks 0..{n - 1}: "
                    + (f"missing {missing}" if missing else f"no such ranks {extra}")
                )
            per_rank = [named_tensors[r] for r in range(n)]
        else:
            per_rank = [named_tensors] * n
        normalized: Dict[int, Dict[str, torch.Tensor]] = {}
        for p in per_rank:
            if id(p) not in normalized:
                normalized[id(p)] = _normalize(p)
        groups = group_ranks([id(p) for p in per_rank])
        return [normalized[id(p)] for p in per_rank], groups

    def update(
        self,
        named_tensors: Union[NamedTensors, Mapping[int, NamedTensors]],
        *,
        version: Optional[str] = None,
        bucket_bytes: Optional[int] = None,
        strict: bool = False,
        flush_cache: bool = True,
        progress: Optional[Progress] = None,
    ) -> UpdateStats:
        """Write ``named_tensors`` into every rank's live parameters; finalize.

        Args:
            named_tensors: ``{name: tensor}`` (or ``model.named_parameters()``)
                in the rollout layout, sent to every rank; or ``{rank: ...}``
                with one mapping per rank (TP > 1).
            version: the new ``weight_version`` (shown in ``/generate``'s
                ``meta_info`` and ``/weight_sync/status``).
            bucket_bytes: override the client's bucket size for this update.
            strict: require every parameter of the rollout model to be sent.
            flush_cache: flush the prefix cache when finalizing (its KV came
                from the old weights; keep True unless you know better).
            progress: ``progress(bucket_stats, done, total)`` after each bucket.

        Returns :class:`UpdateStats`.

        Raises:
            WeightSyncError: the tensors do not fit the rollout model (nothing
                was sent, serving never paused); or the session/sender failed.
            WeightSyncRankError: a rank failed; the session was aborted.
        """
        if not self._busy.acquire(blocking=False):
            raise WeightSyncError("another update of this client is running")
        try:
            return self._update(named_tensors, version, bucket_bytes, strict, flush_cache, progress)
        finally:
            self._busy.release()

    def _update(self, named_tensors, version, bucket_bytes, strict, flush_cache, progress):
        t_call = time.perf_counter()
        version = None if version is None else str(version)
        payloads, groups = self._payloads(named_tensors)
        layouts = self.parameter_layouts()
        items_per_group = []
        for group in groups:
            payload = payloads[group[0]]
            items = [_item(n, t.shape, t.dtype) for n, t in payload.items()]
            for r in group:
                check_tensors(items, layouts[r], self.ranks[r].label(), strict=strict)
            items_per_group.append(items)
        steps, buffer_bytes = plan_steps(items_per_group, bucket_bytes or self.bucket_bytes)
        self._prepare_sender(buffer_bytes)

        run = uuid.uuid4().hex[:8]
        pull_timeout = self.pull_timeout_s
        wait_s = (pull_timeout or DEFAULT_PULL_TIMEOUT_S) + PULL_WAIT_MARGIN_S
        flights: Dict[int, _Flight] = {}  # slot -> flight
        buckets: List[BucketStats] = []
        paths: List[str] = []  # transports the pulls took, in order seen
        session_id, opened = None, False
        t_begin = t_end = 0.0

        def fill(step: Step) -> _Flight:
            slot = step.index % NUM_SLOTS
            token = f"update {run} bucket {step.index}"
            regions = [
                (region.offset,
                 [(s.name, s.offset, s.nbytes, s.shape, s.dtype) for s in region.bucket.slices],
                 [payloads[groups[region.group][0]][s.name] for s in region.bucket.slices])
                for region in step.regions
            ]
            if slot in flights:  # never: the loop lands a slot before refilling it
                raise WeightSyncError(f"internal error: bucket slot {slot} is still in flight")
            t0 = time.perf_counter()
            flight = _Flight(step, slot, token, [], 0.0)
            flights[slot] = flight  # in flight from here on: fill marks it first
            (refs,) = self._sender_call("fill", slot, token, regions)
            flight.refs, flight.fill_seconds = refs, time.perf_counter() - t0
            return flight

        def launch(flight: _Flight) -> None:
            for region, ref in zip(flight.step.regions, flight.refs):
                names = region.bucket.names
                for r in groups[region.group]:
                    flight.pulls.append(
                        (r, self.ranks[r].actor.pull_weights.remote([ref], names, pull_timeout))
                    )

        def land(flight: _Flight) -> None:
            phase = f"pull of bucket {flight.step.index + 1}/{len(steps)}"
            results = self._gather(flight.pulls, phase, wait_s)
            # Every rank's pull of this slot returned: it may be written again.
            self._sender_call("release", flight.slot, flight.token)
            del flights[flight.slot]
            rank_seconds = [float(results[r].get("seconds", 0.0)) for r, _ in flight.pulls]
            for r, _ in flight.pulls:
                for t in str(results[r].get("transport") or "").split(","):
                    if t and t not in paths:
                        paths.append(t)
            slowest = max(rank_seconds, default=0.0)
            stats = BucketStats(
                index=flight.step.index, tensors=flight.step.tensors, bytes=flight.step.nbytes,
                ranks=len(flight.pulls), fill_seconds=flight.fill_seconds,
                pull_seconds=slowest,
                gbps=flight.step.nbytes / slowest / 1e9 if slowest > 0 else 0.0,
                rank_seconds=rank_seconds,
            )
            buckets.append(stats)
            if progress is not None:
                try:
                    progress(stats, len(buckets), len(steps))
                except Exception as e:  # a display bug must not abort an update
                    logger.warning("[RDT] progress callback failed: %s", e)

        try:
            current = fill(steps[0])  # before the session: serving pauses later
            t0 = time.perf_counter()
            session_id = self._begin()
            opened = True
            t_transfer = time.perf_counter()
            t_begin = t_transfer - t0
            for i in range(len(steps)):
                launch(current)
                if i + 1 < len(steps):
                    previous = flights.get((i + 1) % NUM_SLOTS)
                    if previous is not None:
                        land(previous)  # its slot is the one the next bucket goes to
                    current = fill(steps[i + 1])  # overlaps this bucket's pulls
            for flight in sorted(flights.values(), key=lambda f: f.step.index):
                land(flight)
            transfer_seconds = time.perf_counter() - t_transfer + buckets[0].fill_seconds
            t0 = time.perf_counter()
            self._end(session_id, version, flush_cache)
            t_end = time.perf_counter() - t0
        except BaseException as e:
            self._settle(flights, wait_s)
            if opened:
                reason = f"weight-sync client: {type(e).__name__}: {str(e)[:300]}"
                try:
                    self._abort(session_id, reason)
                    if isinstance(e, WeightSyncRankError):
                        e.aborted = True
                except Exception as abort_error:
                    logger.error("[RDT] aborting the update session failed: %s", abort_error)
                    e.add_note(f"aborting the engine's update session failed too: {abort_error}")
            raise

        self.updates += 1
        nbytes = sum(s.nbytes for s in steps)
        moved = sum(
            region.bucket.nbytes * len(groups[region.group]) for s in steps for region in s.regions
        )
        stats = UpdateStats(
            version=version,
            tensors=sum(s.tensors for s in steps),
            bytes=nbytes,
            bytes_moved=moved,
            ranks=len(self.ranks),
            buckets=sorted(buckets, key=lambda b: b.index),
            seconds=time.perf_counter() - t_call,
            transfer_seconds=transfer_seconds,
            begin_seconds=t_begin,
            end_seconds=t_end,
            gbps=nbytes / transfer_seconds / 1e9 if transfer_seconds > 0 else 0.0,
            transport=",".join(paths) or "none",
        )
        logger.info("[RDT] update: %s", stats.summary())
        return stats

    def _settle(self, flights: Dict[int, _Flight], wait_s: float) -> None:
        """After a failure: wait (bounded) for pulls still reading; free their slots."""
        import ray

        for slot, flight in list(flights.items()):
            refs = [ref for _, ref in flight.pulls]
            not_ready = []
            if refs:
                _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
            if not_ready:
                logger.error(
                    "[RDT] %d pull(s) of bucket slot %d did not return; the slot stays "
                    "reserved until they do", len(not_ready), slot,
                )
                self._stuck[slot] = flight
                continue
            try:
                self._sender_call("release", slot, flight.token)
            except WeightSyncError as e:  # e.g. the fill itself failed before marking
                logger.debug("[RDT] release of slot %d after failure: %s", slot, e)

    # ------------------------------------------------------------------ #
    def close(self) -> None:
        """Free the bucket buffers (NIXL deregistration) and the sender actor."""
        import ray

        if self._sender is None:
            return
        if self._own_sender:
            try:
                self._release_rank_mappings()
                self._sender_call("close")
            finally:
                if not self._local_sender:
                    ray.kill(self._sender)
        self._sender = None
        self._sender_bytes = 0

    def __enter__(self) -> "WeightSyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- #
def _item(name: str, shape, dtype) -> TensorItem:
    shape = tuple(int(d) for d in shape)
    dtype = dtype_name(dtype)
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise WeightSyncError(f"{name!r}: unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    return TensorItem(name, shape, dtype, numel * torch_dtype.itemsize)


def _normalize(named: NamedTensors) -> Dict[str, torch.Tensor]:
    items = named.items() if isinstance(named, Mapping) else named
    out: Dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if name in out:
            raise WeightSyncError(f"{name!r} is given twice")
        out[name] = t.detach()
    if not out:
        raise WeightSyncError("empty update: no tensors were given")
    return out


def _not_found(name: str, namespace: str, port: int) -> str:
    import ray

    try:
        listed = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # pragma: no cover
        listed = []
    same_port = sorted(
        f"{a['namespace']}/{a['name']}" for a in listed if f"_port{port}_" in a["name"]
    )
    hint = (
        f" Actors of an engine on port {port}: {same_port[:8]}."
        if same_port
        else f" No actor of any engine on port {port} exists in this cluster."
    )
    return (
        f"no SchedulerActor named {name!r} in namespace {namespace!r}.{hint} Check that "
        "the engine runs with --backend ray --enable-rdt-weight-sync and "
        "--ray-namespace, that this process joined the same cluster, and the layout "
        "(dp/tp/pp sizes, node_ip of rank 0, bundle_index)."
    )
