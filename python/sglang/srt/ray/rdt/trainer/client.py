"""Push new weights from a trainer into a running SGLang engine over RDT, in one call.

:class:`WeightSyncClient` is what a trainer (plain PyTorch, FSDP, verl,
OpenRLHF, miles, ...) uses from any Ray job. It drives the SchedulerActor API
(``register_weight_for_rdt``, ``get_parameter_layout``, ``pull_weights``, ...)
and the engine's update session (``/weight_sync/*`` or ``RayEngine``), so the
caller only hands over tensors::

    from sglang.srt.ray.rdt import WeightSyncClient

    client = WeightSyncClient.connect(port=30000, namespace="rollout", host="10.0.0.5",
                                      dp_size=2, address="10.0.0.5:6379")
    client.register()                 # pin the engine's parameters with NIXL, once
    stats = client.update(model.state_dict(), version=f"step-{step}")   # every step
    client.close()

An update checks every name, shape and dtype against each rank's live
parameters before any byte moves or serving pauses (:class:`WeightSyncError`),
packs the tensors into buckets in a sender whose buffers stay registered across
updates, opens the engine's update session, has every rank pull each bucket
while the next one is filled (:mod:`.pipeline`), and ends the session with the
new ``weight_version``. Any failure aborts the session; a failing rank raises
one :class:`WeightSyncRankError` naming it (docs/rdt_weight_sync.md).

Tensors must already be in the rollout layout: the rollout model's parameter
names, dtypes and shapes. With TP 1 (any DP) pass one mapping; with TP > 1 pass
``{rank: mapping}`` (rank = the engine's global rank, the order of
:attr:`WeightSyncClient.ranks`), reusing the same mapping object for ranks that
take the same tensors (DP replicas of one TP shard) so they share buckets.
Or pass ``layout="hf"`` with one unsharded Hugging Face state dict: sglang's
own loaders reshard it per rank (:mod:`sglang.srt.ray.rdt.trainer.hf_reshard`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from sglang.srt.ray.rdt import gc_pause
from sglang.srt.ray.rdt.defaults import (
    CALL_TIMEOUT_S,
    SESSION_LEASE_S,
    SGLANG_IPC,
    bucket_bytes_for,
)
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError
from sglang.srt.ray.rdt.ranks import gather
from sglang.srt.ray.rdt.trainer import direct
from sglang.srt.ray.rdt.trainer.buckets import plan_steps
from sglang.srt.ray.rdt.trainer.payloads import (
    LayoutCheck,
    NamedTensors,
    Signatures,
    normalize,
    split_payloads,
    tensor_item,
)
from sglang.srt.ray.rdt.trainer.discovery import RankInfo, ensure_ray, find_ranks
from sglang.srt.ray.rdt.trainer.lane import Lanes
from sglang.srt.ray.rdt.trainer.pipeline import BucketPipeline, Progress
from sglang.srt.ray.rdt.trainer.sender_link import SenderLink, release_rank_mappings
from sglang.srt.ray.rdt.trainer.sessions import make_session
from sglang.srt.ray.rdt.trainer.update_run import run_update
from sglang.srt.ray.rdt.trainer.stats import BucketStats, UpdateStats

__all__ = ["WeightSyncClient", "WeightSyncRankError", "UpdateStats", "BucketStats", "RankInfo"]

logger = logging.getLogger(__name__)

default_bucket_bytes = bucket_bytes_for  # the name earlier releases exported


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
            (``UpdateStats.transport``). A rank on the trainer's own GPU is
            never sent NIXL refs (UCX crawls there through TCP, ~0.5 GB/s):
            ``"nixl"``, or ``"auto"`` resolving to it, is refused for it.
        export: ``"auto"`` (default): with ``sender="local"``, CUDA tensors
            and every rank able to read the trainer's GPU over CUDA IPC (same
            node), the ranks read the trainer's own tensors — no bucket copy,
            no bucket memory, one ``pull_weights`` per rank
            (:mod:`.direct`); otherwise buckets. ``"direct"``: always read in
            place — host-memory tensors too, by ranks on this node
            (process_vm_readv) — or fail before anything moves, saying why.
            ``"buckets"``: always buckets. Reading in place against a paused
            engine (no ``url``/``engine``), each rank ends the update in its
            one pull call.
        lane: send pulls of refs a rank on this node has read before (a
            zero-copy update's kept ref; with ``sender="local"``, the kept
            bucket refs) over the rank's call lane (a Unix socket;
            ``engine/local_lane.py``) — ~45 us a round trip instead of a Ray
            actor call (~2.5 ms). ``False``: Ray calls only.
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
        lease_s: float = SESSION_LEASE_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        sender: Any = None,
        sender_options: Optional[Dict[str, Any]] = None,
        transport: str = "auto",
        export: str = "auto",
        lane: bool = True,
    ):
        if transport.lower() not in ("auto", "nixl", "sglang_ipc"):
            raise ValueError(f"transport must be 'auto', 'nixl' or 'SGLANG_IPC', got {transport!r}")
        if export not in ("auto", "direct", "buckets"):
            raise ValueError(f"export must be 'auto', 'direct' or 'buckets', got {export!r}")
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
        if transport.lower() == "nixl":
            transport = "nixl"
        elif transport.lower() == "sglang_ipc":
            transport = SGLANG_IPC
        self.url = url.rstrip("/") if url else None
        self.engine = engine
        self.bucket_bytes = int(bucket_bytes or bucket_bytes_for(device))
        self.device = device
        self.pull_timeout_s = pull_timeout_s
        self.lease_s = float(lease_s)
        self.call_timeout_s = float(call_timeout_s)
        self._layouts: Optional[List[Dict[str, Dict[str, Any]]]] = None
        self._hf_resharder = None  # layout="hf" updates (hf_resharder())
        self._busy = threading.Lock()
        self.updates = 0
        self.transport = transport.lower() if transport.lower() == "auto" else transport
        self.session = make_session(self.url, engine, self._call_all, self.lease_s,
                                    self.call_timeout_s)
        self.sender = SenderLink(device, sender, sender_options, self.call_timeout_s,
                                 self.put_transport)
        self.lanes = Lanes(enabled=lane)  # same-node call lanes to the ranks
        self.pipeline = BucketPipeline(self.ranks, self.sender.call, self._gather, self.lanes)
        self.export = export
        self._statuses: Optional[List[Dict[str, Any]]] = None
        self._direct_used = False  # ranks may hold mappings of the trainer's tensors
        self._direct_refs = direct.DirectRefs()  # the last zero-copy update's refs
        self._signatures = Signatures()  # the last update's tensors, per rank group
        self._checked = LayoutCheck()  # per rank group: the last layout that passed
        self._in_place = direct.InPlaceCheck()  # the last tensors read in place
        self._trainer_gpu: Optional[tuple] = None

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
        ensure_ray(address)
        actors, names = find_ranks(
            port, namespace, node_ip=node_ip, host=host, dp_size=dp_size, tp_size=tp_size,
            pp_size=pp_size, bundle_index=bundle_index,
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

    def _call_all(self, method: str, *args, timeout_s: Optional[float] = None,
                  only: Optional[Sequence[int]] = None) -> List[Any]:
        ranks = self.ranks if only is None else [self.ranks[i] for i in only]
        calls = [(r.index, getattr(r.actor, method).remote(*args)) for r in ranks]
        out = self._gather(calls, method, timeout_s or self.call_timeout_s)
        return [out[r.index] for r in ranks]

    def register(self, named_tensors: Optional[NamedTensors] = None) -> List[Dict[str, Any]]:
        """Pin every rank's parameters with NIXL once and prepare the bucket buffers.

        Idempotent. Returns each rank's ``register_weight_for_rdt()`` result
        (``{"registered": False, "reason": ...}`` under ``--enable-memory-saver``,
        where pulls register per call instead).

        ``named_tensors``: the tensors later updates will send (as for
        :meth:`update`), checked now. When the ranks read them in place, they
        are put now and every rank does all of a pull but the copy
        (``prepare_pull_weights``: plan, CUDA IPC mappings of the trainer's
        memory), writing nothing. With buckets, the buckets their updates will
        fill are put now (the sender keeps those refs) and every rank
        prepares its pulls of them. Either way the first update then costs
        what later ones do.
        """
        out = self._call_all("register_weight_for_rdt")
        layouts = self.parameter_layouts(refresh=True)
        self._statuses = None
        if direct.client_blocker(self) is None:
            if named_tensors is not None:
                direct.prepare(self, named_tensors)
            return out  # updates read the trainer's tensors: no buckets to allocate
        if named_tensors is not None:
            payloads, groups = split_payloads(named_tensors, len(self.ranks))
            items_per_group = self._checked.items_per_group(
                payloads, groups, layouts, [r.label() for r in self.ranks], False)
        else:
            items_per_group = [[tensor_item(n, spec["shape"], spec["dtype"])
                                for n, spec in layouts[0].items()]]
        if any(items_per_group):
            steps, buffer_bytes = plan_steps(items_per_group, self.bucket_bytes)
            self.pipeline.reclaim_stuck()
            self.sender.prepare(buffer_bytes, self.ranks)
            if named_tensors is not None:
                if self.sender.local:
                    direct.open_lanes(self)  # first: the ranks then keep the primed refs
                self.pipeline.prime(steps, groups, self.call_timeout_s)
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
        self._statuses = self._call_all("get_weight_sync_status")
        return self._statuses

    def _cached_status(self) -> List[Dict[str, Any]]:
        return self._statuses if self._statuses is not None else self.status()

    def put_transport(self) -> str:
        """The transport the client's sender puts with (``auto`` resolved
        against what every rank accepts; NIXL refused for a rank on this
        trainer's GPU)."""
        return direct.resolve_put_transport(self)

    # ------------------------------------------------------------------ #
    # Update
    # ------------------------------------------------------------------ #
    def update(
        self,
        named_tensors: Union[NamedTensors, Mapping[int, NamedTensors]],
        *,
        version: Optional[str] = None,
        bucket_bytes: Optional[int] = None,
        strict: bool = False,
        flush_cache: bool = True,
        progress: Optional[Progress] = None,
        layout: str = "rollout",
        hf_model_path: Optional[str] = None,
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
            layout: ``"rollout"`` (default: the tensors are the ranks' own
                parameters) or ``"hf"``: ``named_tensors`` is one unsharded
                state dict under the Hugging Face checkpoint's names (what a
                trainer holds after gathering); sglang's own loaders fuse and
                shard it for each rank (:meth:`hf_resharder`), after checking
                every name, shape and dtype.
            hf_model_path: for ``layout="hf"``, the rollout model's checkpoint
                directory on this host (default: the engine's ``--model-path``).

        Returns :class:`UpdateStats`.

        Raises:
            WeightSyncError: the tensors do not fit the rollout model (nothing
                was sent, serving never paused); or the session/sender failed.
            WeightSyncRankError: a rank failed; the session was aborted.
        """
        if not self._busy.acquire(blocking=False):
            raise WeightSyncError("another update of this client is running")
        try:
            if layout == "hf":
                named_tensors = self.hf_resharder(hf_model_path).reshard(
                    normalize(named_tensors), strict=strict
                )
            elif layout != "rollout":
                raise ValueError(f"layout must be 'rollout' or 'hf', got {layout!r}")
            # No full garbage collection (75-107 ms) inside the update.
            with gc_pause.paused("trainer update"):
                return self._update(named_tensors, version, bucket_bytes, strict, flush_cache, progress)
        finally:
            self._busy.release()

    def hf_resharder(self, model_path: Optional[str] = None):
        """The :class:`~sglang.srt.ray.rdt.trainer.hf_reshard.HFResharder` of
        this engine, built once from its ``/server_info`` and each rank's
        ``/parallelism_config?rank=R`` (needs ``url=``)."""
        if self._hf_resharder is None:
            from sglang.srt.ray.rdt.trainer.hf_reshard import HFResharder

            if not self.url:
                raise WeightSyncError(
                    "layout='hf' reads the engine's /server_info and /parallelism_config: "
                    "build the client with url= (or WeightSyncClient.connect)"
                )
            self._hf_resharder = HFResharder.from_engine_url(
                self.url, len(self.ranks), model_path=model_path, timeout_s=self.call_timeout_s
            )
        return self._hf_resharder

    def _update(self, named_tensors, version, bucket_bytes, strict, flush_cache, progress):
        return run_update(self, named_tensors, version, bucket_bytes, strict, flush_cache, progress)

    # ------------------------------------------------------------------ #
    def close(self) -> None:
        """Free the bucket buffers (NIXL deregistration) and the sender actor;
        make the ranks close their mappings of the trainer's tensors."""
        self._direct_refs.clear()  # lets go of the trainer's tensors
        self.lanes.close()
        try:
            if self._direct_used:
                self._direct_used = False
                from sglang.srt.ray.rdt.transport import sglang_ipc

                release_rank_mappings(self.ranks, sglang_ipc.sender_token(),
                                      self.call_timeout_s, "the trainer's tensors")
        finally:
            self.sender.close(self.ranks)

    def __enter__(self) -> "WeightSyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
