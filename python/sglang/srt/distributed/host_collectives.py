"""Which of sglang's CUDA communicators a process group may carry.

``GroupCoordinator`` attaches CUDA communicators to every model-parallel group
of more than one rank: PyNccl (on by default), custom all-reduce, MSCCL++ and
torch symmetric memory. They need CUDA device memory and a CUDA device per rank.
A group on the ``gloo`` backend -- what ``--device cpu`` gets, e.g.
``--device cpu --tp-size 2`` -- has neither: building PyNccl there fails with
``ValueError: Expected a cuda device, but got: cpu``. Such a group does its
collectives through ``torch.distributed`` on the gloo group itself (the
coordinator's fall-back path when no communicator is attached), so none of the
CUDA communicators is attached to it.
"""

from __future__ import annotations

# torch.distributed backends whose tensors live in host memory.
HOST_BACKENDS = frozenset({"gloo"})


def uses_cuda_communicators(backend) -> bool:
    """Whether a group on ``backend`` may attach sglang's CUDA communicators."""
    return str(backend).lower() not in HOST_BACKENDS
