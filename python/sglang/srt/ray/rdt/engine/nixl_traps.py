"""Two silent NIXL traps a rank names as soon as it meets them.

UCX under NIXL finds no GPU path between two processes of one GPU (colocated
training) nor for memory from PyTorch's expandable segments: it falls back to
TCP over loopback, ~0.5 GB/s on an H200 — a 1 GiB bucket then takes seconds
instead of a millisecond. The rank warns before a pull whose NIXL source is
its own GPU, and after any large NIXL pull far below a GPU link; once per
writer, each naming the fix.
"""

from __future__ import annotations

import logging

from sglang.srt.ray.rdt.engine.refs import SAME_GPU_NIXL, nixl_source_on_this_gpu

logger = logging.getLogger(__name__)

# A NIXL pull at least this large and slower than this is warned about: it
# fell back to TCP (no GPU path).
SLOW_NIXL_MIN_BYTES = 64 << 20
SLOW_NIXL_BPS = 2e9


class NixlTrapWarnings:
    def __init__(self, device):
        self.device = device
        self._warned: set = set()  # writers (and slow-pull keys) already told

    def before_pull(self, refs, writes) -> None:
        """Before the bytes move: a NIXL ref from this rank's own GPU crawls
        (TCP over loopback). Said once per writer, with the fix."""
        for ref, (_, writer) in zip(refs, writes):
            if writer.id in self._warned:
                continue
            why = nixl_source_on_this_gpu(ref, self.device)
            if why is not None:
                self._warned.add(writer.id)
                logger.warning("[RDT] %s (%s): %s.", why, writer.label, SAME_GPU_NIXL)

    def after_pull(self, nbytes: int, seconds: float, writes) -> None:
        """After the bytes moved: a large NIXL pull far below any GPU link."""
        if nbytes < SLOW_NIXL_MIN_BYTES or seconds <= 0 or nbytes / seconds >= SLOW_NIXL_BPS:
            return
        key = ("slow",) + tuple(w.id for _, w in writes)
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "[RDT] a NIXL pull of %.1f MiB ran at %.2f GB/s: UCX found no GPU path and "
            "fell back to TCP. Causes seen: trainer and rank on the same GPU (%s); "
            "tensors in expandable segments (unset PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True); no RDMA between nodes. UCX_PROTO_INFO=y prints "
            "the protocol UCX picked.", nbytes / 2**20, nbytes / seconds / 1e9, SAME_GPU_NIXL,
        )
