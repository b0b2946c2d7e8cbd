"""What a same-node read is given, and what it reports back; pickled by this module's name (sender and readers
run the same fork)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from sglang.srt.ray.rdt.transport.compat import transport_base_classes

CommunicatorMetadata, _TransportManager, TensorTransportMetadata = transport_base_classes()

# (base in the sender, size, 64-byte IPC handle) of kept memory, mapped until the sender releases it or exits.
Segment = Tuple[int, int, bytes]


@dataclass
class IpcPart:
    """GPU tensors in kept memory, as CUDA IPC handles of the segments that hold them."""

    node_id: str
    sender: str  # one token per sender process
    pid: int
    device_uuid: str
    segments: List[Segment]
    seg: np.ndarray  # per tensor: index into segments (int64)
    offset: np.ndarray  # per tensor: byte offset in its segment (int64)
    nbytes: np.ndarray  # per tensor (int64)
    # unique in the sender: a lane sends a description once and names it after
    kept_id: int = 0


@dataclass
class CmaPart:
    """Host-memory tensors readable with process_vm_readv on this host."""

    node_id: str
    sender: str
    pid: int
    start_time: int  # the sender's /proc/<pid>/stat start time (pid reuse guard)
    address: np.ndarray  # per tensor (int64)
    nbytes: np.ndarray  # per tensor (int64)


@dataclass
class SglangIpcTransportMetadata(TensorTransportMetadata):  # type: ignore[misc,valid-type]
    """An ``SGLANG_IPC`` ref's metadata (``tensor_meta``: shapes and dtypes)."""

    ipc: Optional[IpcPart] = None
    cma: Optional[CmaPart] = None
    ipc_unavailable: Optional[str] = None  # why the sender put no same-node part
    nixl: Any = None  # Ray's NixlTransportMetadata of the same tensors

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class IpcCommunicatorMetadata(CommunicatorMetadata):  # type: ignore[misc,valid-type]
    """Nothing: the transport is one-sided."""


@dataclass
class ReadResult:
    """What one read of a source into its targets did, returned by the reader."""

    path: str  # "cuda_ipc" | "cma" | "nixl"
    tensors: int
    bytes: int
    seconds: float
    reason: Optional[str] = None  # why not a same-node read (path "nixl")
    method: str = ""  # how the bytes moved: kernel | batch | ce | process_vm_readv | nixl
    opened: int = 0  # CUDA IPC mappings opened for this read (kept after it)
    reused: int = 0  # mappings found open
    copy_seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.path if not self.reason else f"{self.path} ({self.reason})"


class MappingFailed(RuntimeError):
    """A same-node read or write was refused before any byte moved (NIXL, or the slots, may still serve it)."""


@dataclass
class Targets:
    """Where a read lands: tensors and, once computed, their addresses and sizes."""

    tensors: List
    ptrs: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def of(cls, tensors) -> "Targets":
        tensors = list(tensors)
        return cls(tensors, *addresses(tensors))

    def check(self, nbytes: np.ndarray) -> None:
        """Raise before any byte moves unless the source's sizes fit exactly."""
        if len(nbytes) != len(self.tensors):
            raise ValueError(f"Length of tensor_buffers ({len(self.tensors)}) does not match "
                             f"length from object metadata ({len(nbytes)}).")
        bad = np.nonzero(nbytes != self.nbytes)[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"target buffer {i} holds {int(self.nbytes[i])} bytes, the source tensor {int(nbytes[i])}")


def addresses(tensors) -> Tuple[np.ndarray, np.ndarray]:
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, tensors), np.int64, len(tensors))
    return ptrs, np.array([t.nbytes for t in tensors], np.int64)

