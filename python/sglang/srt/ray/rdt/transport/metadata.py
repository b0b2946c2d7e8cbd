"""What an ``SGLANG_IPC`` ref carries, and what a fetch of one reports.

Plain dataclasses, pickled by Ray from the sender to every receiver (by this
module's name: sender and receivers run the same fork).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from sglang.srt.ray.rdt.transport.compat import transport_base_classes

CommunicatorMetadata, _TransportManager, TensorTransportMetadata = transport_base_classes()


@dataclass
class IpcCommunicatorMetadata(CommunicatorMetadata):  # type: ignore[misc,valid-type]
    """Nothing: the transport is one-sided."""


@dataclass
class IpcPart:
    """GPU tensors as CUDA IPC handles of the segments that hold them."""

    node_id: str
    sender: str  # one token per sender process
    pid: int
    device_uuid: str
    # (segment base in the sender, segment size, 64-byte IPC handle)
    segments: List[Tuple[int, int, bytes]]
    # per tensor: (segment index, byte offset in the segment, nbytes)
    tensors: List[Tuple[int, int, int]]
    # every segment is a buffer its owner keeps across updates and releases
    # only after asking the receivers to unmap it (WeightSyncClient's buckets)
    persistent: bool = False


@dataclass
class CmaPart:
    """CPU tensors readable with process_vm_readv by a process on this host."""

    node_id: str
    sender: str
    pid: int
    start_time: int  # the sender's /proc/<pid>/stat start time (pid reuse guard)
    tensors: List[Tuple[int, int]]  # (address, nbytes) per tensor


@dataclass
class SglangIpcTransportMetadata(TensorTransportMetadata):  # type: ignore[misc,valid-type]
    ipc: Optional[IpcPart] = None
    ipc_unavailable: Optional[str] = None
    cma: Optional[CmaPart] = None
    nixl: Any = None  # a NixlTransportMetadata, or None

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class FetchInfo:
    """What one fetch of a ref did in this process: the path, why, timings."""

    obj_id: str
    path: str  # "cuda_ipc" | "cma" | "nixl"
    reason: Optional[str] = None
    tensors: int = 0
    bytes: int = 0
    copies: int = 0
    streams: int = 0
    engine: str = ""
    method: str = ""
    opened: int = 0
    reused: int = 0
    open_seconds: float = 0.0
    copy_seconds: float = 0.0
    seconds: float = 0.0
    plan: str = ""  # "new" | "reused" (the last identical pull's checked copy plan)


class MappingFailed(RuntimeError):
    """A same-node read was refused before any byte moved (NIXL may still serve it)."""
