"""Transports of RDT weight sync: how bytes move between processes.

- :mod:`.same_node` — this process's sender identity, exporter and reader of
  same-node reads: :mod:`.cuda_ipc` (GPU memory: CUDA IPC handles, one SM
  copy kernel on one GPU) and :mod:`.cma` (host memory: ``process_vm_readv``);
- :mod:`.sglang_ipc` — the ``SGLANG_IPC`` Ray tensor transport: refs carrying
  a same-node part and Ray's NIXL metadata;
- :mod:`.metadata` — what a same-node read is given and what it reports;
- :mod:`.cuda_driver` — the CUDA driver and NVRTC calls, through ctypes;
- :mod:`.compat` — every Ray-private name the package uses.

May import: torch, numpy, Ray and each other. Never imports the engine or
trainer sides, nor sglang's serving modules.
"""
