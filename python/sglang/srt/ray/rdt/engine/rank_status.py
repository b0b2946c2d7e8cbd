"""What a rank reports: its status record, its parameters' layout and checksums."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.ray.rdt.errors import dtype_name


@dataclass
class RankStatus:
    """What ``get_weight_sync_status`` reports (a dict at the actor's edge)."""

    enabled: bool = True
    weights_consistent: bool = True
    inconsistent_reason: Optional[str] = None
    weight_version: Optional[str] = None
    update_open: bool = False
    update_in_progress: Optional[Dict[str, Any]] = None
    updates: int = 0
    failed_updates: int = 0
    failures: Dict[str, int] = field(default_factory=dict)
    last_update: Optional[Dict[str, Any]] = None
    pulls: int = 0
    failed_pulls: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    last_pull: Optional[Dict[str, Any]] = None
    registered: bool = False
    registrations: int = 0
    weights_released: bool = False
    registration_disabled_reason: Optional[str] = None
    transports: List[str] = field(default_factory=list)
    # where this rank reads same-node sources from: its Ray node, the GPUs it sees
    ipc_reach: Optional[Dict[str, Any]] = None
    device_uuid: Optional[str] = None
    lane: Dict[str, Any] = field(default_factory=lambda: {"open": False})
    kept_mappings: Dict[str, int] = field(default_factory=dict)
    event_loop: str = "not_started"
    idle_sleep: str = "off"
    # where begin/finalize/abort go: the first rank of a TP/PP group
    group_entry: bool = True
    # LoRA adapters registered for weight sync: version, checksum, size (engine/lora_sync.py)
    lora_adapters: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def parameter_layout(named_parameters) -> Dict[str, Dict[str, Any]]:
    """``{name: {"shape", "dtype", "data_ptr"}}``: what a pull expects."""
    return {name: {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "data_ptr": p.data_ptr()}
            for name, p in named_parameters}


def parameter_checksums(named_parameters) -> Dict[str, str]:
    """sha256 of every parameter's bytes."""
    out = {}
    for name, p in named_parameters:
        data = p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.sha256(data.tobytes()).hexdigest()
    return out
