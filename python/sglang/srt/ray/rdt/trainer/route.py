"""How an update reaches each rank: :func:`decide_route` over the ranks' statuses (docs/architecture.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from sglang.srt.ray.rdt.defaults import SGLANG_IPC
from sglang.srt.ray.rdt.errors import WeightSyncError

logger = logging.getLogger(__name__)


@dataclass
class Route:
    """How an update reaches each rank (:meth:`WeightSyncClient.route`)."""

    direct: bool  # the ranks read the trainer's own tensors (else: bucket slots)
    lanes: Set[int] = field(default_factory=set)  # ranks reached over their call lane
    ref_transport: Optional[str] = None  # how slot refs are put for the other ranks
    why_not_direct: Optional[str] = None


def decide_route(ranks: Sequence[Any], statuses: List[Dict[str, Any]], lanes: Set[int],
                 transport: str, export: str, device) -> Route:
    """The route for ``ranks`` given their statuses, those with a working lane and the client's settings;
    :class:`WeightSyncError` when ``transport`` or ``export`` cannot be honoured."""
    others = [r for r in ranks if r.index not in lanes]
    ref_transport = None
    if others:
        accepts = all(SGLANG_IPC in (statuses[r.index].get("transports") or []) for r in others)
        if transport == SGLANG_IPC and not accepts:
            raise WeightSyncError("transport='SGLANG_IPC', but not every rank accepts it "
                                  "(get_weight_sync_status()['transports'])")
        ref_transport = SGLANG_IPC if transport != "nixl" and accepts else "nixl"
        if ref_transport == "nixl":
            _refuse_nixl_on_trainer_gpu(device, [statuses[r.index] for r in others], [r.label() for r in others])
    why = _why_not_direct(ranks, statuses, lanes, export, device)
    if why is not None and export == "direct":
        raise WeightSyncError(f"export='direct': the ranks cannot read this trainer's tensors "
                              f"in place ({why}); nothing was sent")
    logger.info("[RDT] weight-sync route: %s, %d of %d ranks over lanes%s",
                "direct" if why is None else f"buckets ({why})", len(lanes), len(ranks),
                f", refs over {ref_transport}" if ref_transport else "")
    return Route(why is None, lanes, ref_transport, why)


def _trainer_gpu(device) -> Optional[Tuple[str, str]]:
    """(node id, GPU UUID) of the trainer's ``device``; None on the CPU."""
    if device.type != "cuda":
        return None
    from sglang.srt.ray.rdt.transport import same_node
    from sglang.srt.ray.rdt.transport.cuda_driver import device_uuid

    return same_node.node_id(), device_uuid(device.index)


def _why_not_direct(ranks, statuses, lanes: Set[int], export: str, device) -> Optional[str]:
    if export == "buckets":
        return "export='buckets'"
    missing = [r.label() for r in ranks if r.index not in lanes]
    if missing:
        return f"{', '.join(missing)} cannot be reached over a same-node lane"
    gpu = _trainer_gpu(device)
    if gpu is None:
        return None if export == "direct" else "host-memory tensors are read in place only with export='direct'"
    for st, r in zip(statuses, ranks):
        if gpu[1] not in ((st.get("ipc_reach") or {}).get("gpus") or []):
            return f"{r.label()} does not see this trainer's GPU {gpu[1]}"
    return None


def _refuse_nixl_on_trainer_gpu(device, statuses, labels) -> None:
    gpu = _trainer_gpu(device)
    shared = [label for st, label in zip(statuses, labels) if gpu is not None
              and (st.get("ipc_reach") or {}).get("node_id") == gpu[0] and st.get("device_uuid") == gpu[1]]
    if shared:
        raise WeightSyncError(f"{', '.join(shared)} run(s) on this trainer's GPU, and NIXL cannot move bytes between "
                              "two processes of one GPU (UCX falls back to TCP over loopback: ~0.5 GB/s measured on "
                              "an H200). Use transport='auto' or 'SGLANG_IPC' (CUDA IPC) with lane=True.")
