"""Zero-copy updates: the ranks read the trainer's own tensors.

(Host-memory tensors are read in place too, with ``export="direct"``: ranks on
the trainer's Ray node read them with process_vm_readv. What follows is about
CUDA tensors, where ``export="auto"`` picks this path itself.)

When the trainer's tensors already are what the ranks want — contiguous CUDA
tensors in the rollout layout on the client's device — and every rank can
read that GPU over CUDA IPC (same Ray node, the GPU visible to it), there is
nothing to stage: the client puts each rank group's tensors as they are, in
one ``SGLANG_IPC`` ref without NIXL metadata, and every rank pulls it in one
``pull_weights`` call. No bucket copy (on one GPU it would compete with the
ranks' own copy for memory bandwidth), no bucket memory, one call per rank
instead of one per bucket (a call costs ~3 ms of Ray round trips, more than a
1 GiB copy on one H200).

The tensors' segments are declared persistent: ranks keep their mappings from
one update to the next (re-opening 146-256 segments costs ~17 ms) and close
those no update read since the previous one ended, so memory the trainer
freed is held at most one update longer (``WeightSyncClient.close`` releases
everything). Safe to read: every update waits for the trainer's queued GPU work (device
sync) before any rank reads, and ``update`` returns only after every rank's
copy finished, so the tensors must only not change *during* ``update``, as
with buckets.

The ref is kept for the next update (:class:`DirectRefs`): when a group's
tensors are at the same addresses with the same shapes and dtypes, the same
ref serves again — no ``ray.put`` (3-5 ms for 256 tensors), and the ranks
reuse their plans. That is safe because the kept ref holds the tensors it was
put with: their memory cannot be freed, so equal addresses mean the same
storage. The price: tensors the trainer dropped stay allocated until the next
update puts new ones, or ``WeightSyncClient.close``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from sglang.srt.ray.rdt.defaults import SGLANG_IPC
from sglang.srt.ray.rdt.ranks import settle
from sglang.srt.ray.rdt.trainer.lane import LaneCall, Lanes
from sglang.srt.ray.rdt.trainer.discovery import RankInfo
from sglang.srt.ray.rdt.trainer.payloads import signature, split_payloads
from sglang.srt.ray.rdt.trainer.pipeline import PipelineRun, prepare_pulls
from sglang.srt.ray.rdt.trainer.stats import BucketStats


def trainer_gpu(device: str) -> Optional[Tuple[str, str]]:
    """(Ray node id, GPU UUID) of this process's ``device``, None off CUDA."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    import ray

    from sglang.srt.ray.rdt.transport.cuda_driver import device_uuid

    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return ray.get_runtime_context().get_node_id(), device_uuid(index)


def ranks_blocker(statuses: Sequence[Mapping[str, Any]], gpu: Optional[Tuple[str, str]],
                  labels: Sequence[str], host_node: Optional[str] = None) -> Optional[str]:
    """Why not every rank can read the trainer's tensors in place, or None:
    over CUDA IPC from ``gpu`` (node, UUID), or — host memory, ``gpu`` None —
    with process_vm_readv on ``host_node`` (None: host memory is not read in place)."""
    if gpu is None and host_node is None:
        return "the tensors are not on a CUDA device of this process"
    node, uuid = gpu if gpu is not None else (host_node, None)
    for st, label in zip(statuses, labels):
        if SGLANG_IPC not in (st.get("transports") or []):
            return f"{label} does not accept {SGLANG_IPC} refs"
        reach = st.get("ipc_reach") or {}
        if reach.get("node_id") != node:
            return f"{label} is on another node (or does not say where it is)"
        if uuid is not None and uuid not in (reach.get("gpus") or []):
            return f"{label} does not see this trainer's GPU {uuid}"
    return None


def shared_gpu_ranks(statuses: Sequence[Mapping[str, Any]], gpu: Optional[Tuple[str, str]],
                     labels: Sequence[str]) -> List[str]:
    """The ranks that run on the trainer's own GPU (same node, same UUID)."""
    if gpu is None:
        return []
    node, uuid = gpu
    return [
        label for st, label in zip(statuses, labels)
        if (st.get("ipc_reach") or {}).get("node_id") == node and st.get("device_uuid") == uuid
    ]


def tensors_blocker(payloads: Sequence[Mapping[str, torch.Tensor]], device: str) -> Optional[str]:
    """Why some tensor cannot be put as it is, or None."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # Flags and the ordinal, not a device object per tensor.
    cuda, cpu, index = dev.type == "cuda", dev.type == "cpu", dev.index
    for payload in payloads:
        for name, t in payload.items():
            if not ((t.is_cuda and t.get_device() == index) if cuda else (cpu and t.is_cpu)):
                return f"{name!r} is on {t.device}, the client's device is {dev}"
            if not t.is_contiguous():
                return f"{name!r} is not contiguous"
    return None


class DirectRefs:
    """The refs of the last zero-copy update, per rank group, with what they
    were put from (addresses, shapes, dtypes, strides)."""

    def __init__(self):
        self._refs: Dict[int, Tuple[tuple, Any]] = {}
        self.reused = 0

    @staticmethod
    def _key(tensors: Sequence[torch.Tensor]) -> tuple:
        return tuple((t.data_ptr(), t.shape, t.dtype, t.stride()) for t in tensors)

    def ref_for(self, group: int, tensors: List[torch.Tensor], put: Callable[[List[torch.Tensor]], Any],
                key: Optional[tuple] = None):
        """``key``: the tensors' ``payloads.signature`` when the caller has it."""
        key = self._key(tensors) if key is None else key
        kept = self._refs.get(group)
        if kept is not None and kept[0] == key:
            # The trainer's queued GPU work on these tensors must be done
            # before a rank reads them (a put synchronises for us otherwise).
            if tensors and tensors[0].is_cuda:
                torch.cuda.synchronize(tensors[0].device)
            self.reused += 1
            return kept[1]
        self._refs.pop(group, None)  # drop the old ref (and its hold) first
        ref = put(tensors)
        self._refs[group] = (key, ref)
        return ref

    def clear(self) -> None:
        self._refs.clear()


def group_refs(payloads, groups, put, refs_cache: Optional[DirectRefs] = None,
               sigs: Optional[Sequence[tuple]] = None):
    """Each rank group's ref (kept ones reused) and its tensors' names."""
    refs, names = [], []
    for i, group in enumerate(groups):
        payload = payloads[group[0]]
        names.append(list(payload))
        tensors = list(payload.values())
        refs.append(put(tensors) if refs_cache is None else
                    refs_cache.ref_for(i, tensors, put, sigs[i] if sigs is not None else signature(payload)))
    return refs, names


class InPlaceCheck:
    """:func:`tensors_blocker`, not repeated for tensors whose signatures
    (``payloads.signature``: addresses, shapes, strides) passed it last time
    — the same storage is on the same device and just as contiguous."""

    def __init__(self):
        self._passed: Optional[tuple] = None

    def blocker(self, payloads, device: str, sigs: Sequence[tuple]) -> Optional[str]:
        key = (str(device), tuple(sigs))
        if key == self._passed:
            return None
        why = tensors_blocker(payloads, device)
        self._passed = key if why is None else None
        return why


def run_direct(
    ranks: Sequence[RankInfo],
    payloads: Sequence[Mapping[str, torch.Tensor]],
    groups: List[List[int]],
    run: PipelineRun,
    *,
    put: Callable[[List[torch.Tensor]], Any],
    refs_cache: Optional[DirectRefs] = None,
    gather: Callable[[Sequence[Tuple[int, Any]], str, float], Dict[int, Any]],
    open_session: Callable[[], Optional[str]],
    pull_timeout: Optional[float],
    wait_s: float,
    finalize: Optional[Dict[str, Any]] = None,
    lanes: Optional[Lanes] = None,
    sigs: Optional[Sequence[tuple]] = None,
) -> PipelineRun:
    """One ref and one ``pull_weights`` per rank group; fills ``run``. With
    ``finalize`` each rank also ends the update in that call (its one pull is
    its last). ``lanes``: a rank on this node that read the ref before gets
    the call over its lane (:mod:`.lane`) instead of through Ray."""
    t_start = time.perf_counter()
    refs, names = group_refs(payloads, groups, put, refs_cache, sigs)
    put_seconds = time.perf_counter() - t_start
    t0 = time.perf_counter()
    run.session_id = open_session()
    run.session_open = True
    t_transfer = time.perf_counter()
    run.begin_seconds = t_transfer - t0
    extra = {} if finalize is None else {"finalize": finalize}
    lanes = lanes or Lanes(enabled=False)
    sends = [(r, ref, ns) for ref, ns, group in zip(refs, names, groups) for r in group]
    calls = [(r, lanes.pull(ranks[r], ref, ns, pull_timeout, extra)) for r, ref, ns in sends]
    phase = "pull of the trainer's tensors (zero-copy)" + (" and finalize" if finalize else "")
    try:
        results = gather(calls, phase, wait_s)
    except BaseException:
        # Ranks may still be reading the trainer's tensors: wait (bounded)
        # before the caller may change them.
        settle(calls, wait_s)
        raise
    run.lane_calls = sum(isinstance(c, LaneCall) for _, c in calls)
    for r, ref, _ in sends:
        lanes.held(r, ref)
    run.transfer_seconds = time.perf_counter() - t_transfer + put_seconds
    for r, _ in calls:
        for t in str(results[r].get("transport") or "").split(","):
            if t and t not in run.paths:
                run.paths.append(t)
    for i, (group, ns) in enumerate(zip(groups, names)):
        nbytes = int(results[group[0]]["bytes"])  # what the rank's plan counted
        rank_seconds = [float(results[r].get("seconds", 0.0)) for r in group]
        slowest = max(rank_seconds, default=0.0)
        run.buckets.append(BucketStats(
            index=i, tensors=len(ns), bytes=nbytes, ranks=len(group),
            fill_seconds=put_seconds / len(groups), pull_seconds=slowest,
            gbps=nbytes / slowest / 1e9 if slowest > 0 else 0.0, rank_seconds=rank_seconds,
        ))
    return run


def put_direct(tensors):
    """Put the trainer's own tensors. CUDA: IPC only (every rank reads them on
    this node), segments kept mapped across updates. Host memory: read with
    process_vm_readv, with NIXL metadata for a rank the kernel refuses it to."""
    import ray

    from sglang.srt.ray.rdt.transport import sglang_ipc

    sglang_ipc.register()
    cuda = bool(tensors) and tensors[0].is_cuda
    with sglang_ipc.put_options(nixl=False if cuda else None, persistent=True if cuda else None):
        return ray.put(tensors, _tensor_transport=SGLANG_IPC)


def prepare(client, named_tensors) -> Optional[str]:
    """Put ``named_tensors`` as the next zero-copy update will (the ref is
    kept for it) and have every rank do all of that pull but the copy.
    Returns why nothing was prepared, or None."""
    payloads, groups = split_payloads(named_tensors, len(client.ranks))
    client._checked.items_per_group(payloads, groups, client.parameter_layouts(),
                                    [r.label() for r in client.ranks], False)
    blocker = tensors_blocker([payloads[g[0]] for g in groups], client.device)
    if blocker is not None:
        return blocker
    client._direct_used = True
    open_lanes(client)  # before the prepare: the ranks then keep its refs
    refs, names = group_refs(payloads, groups, put_direct, client._direct_refs)
    prepare_pulls(client.ranks, list(zip(refs, names, groups)), client._gather, client.lanes,
                  "prepare_pull_weights", client.call_timeout_s)
    return None


def open_lanes(client) -> None:
    """Open the call lanes of the client's ranks on this node (once)."""
    client.lanes.open(client.ranks, client._cached_status(), client.call_timeout_s)


# --------------------------------------------------------------------------- #
# The client's choices (functions of a WeightSyncClient's state)
# --------------------------------------------------------------------------- #
def client_gpu(client):
    """(Ray node, GPU UUID) of the client's device in this process (cached)."""
    if client._trainer_gpu is None:
        client._trainer_gpu = (trainer_gpu(client.device),)
    return client._trainer_gpu[0]


def client_blocker(client) -> Optional[str]:
    """Why the client's updates cannot read the trainer's own tensors (rank
    side or settings), or None. Host memory is read in place only with
    ``export="direct"``."""
    if client.export == "buckets":
        return "export='buckets'"
    if not client.sender.local:
        return "the buckets live in a sender actor (sender='local' reads the trainer's tensors)"
    if client.put_transport() != SGLANG_IPC:
        return f"transport {client.transport!r}"
    gpu = client_gpu(client)
    host_node = None
    if gpu is None and client.export == "direct" and torch.device(client.device).type == "cpu":
        import ray

        host_node = ray.get_runtime_context().get_node_id()
    return ranks_blocker(client._cached_status(), gpu, [r.label() for r in client.ranks], host_node)


def refuse_nixl_on_shared_gpu(client) -> None:
    from sglang.srt.ray.rdt.errors import WeightSyncError

    if client.transport == SGLANG_IPC or not client.sender.local:
        return
    shared = shared_gpu_ranks(client._cached_status(), client_gpu(client),
                              [r.label() for r in client.ranks])
    if shared:
        raise WeightSyncError(
            f"{', '.join(shared)} run(s) on this trainer's GPU, and NIXL cannot move bytes "
            "between two processes of one GPU (UCX falls back to TCP over loopback: "
            "~0.5 GB/s measured on an H200). Use transport='auto' or 'SGLANG_IPC' "
            "(CUDA IPC; every rank of this engine accepts it when it lists SGLANG_IPC "
            "in get_weight_sync_status()['transports'])."
        )


def resolve_put_transport(client) -> str:
    """``auto`` resolved against what every rank accepts (SGLANG_IPC when all
    do, else nixl); NIXL is refused for a rank on the trainer's own GPU."""
    if client.transport == "auto":
        accepted = [set(st.get("transports") or ["NIXL"]) for st in client._cached_status()]
        client.transport = SGLANG_IPC if all(SGLANG_IPC in a for a in accepted) else "nixl"
        refuse_nixl_on_shared_gpu(client)
    elif client.transport == "nixl" and str(client.device).startswith("cuda"):
        refuse_nixl_on_shared_gpu(client)
    return client.transport
