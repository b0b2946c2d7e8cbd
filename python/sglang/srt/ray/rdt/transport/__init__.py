"""Transports of RDT weight sync: how bytes move between processes.

- :mod:`.sglang_ipc` — the ``SGLANG_IPC`` Ray tensor transport (same-node
  fast path: CUDA IPC + copy engine for GPU memory, ``process_vm_readv`` for
  CPU memory, NIXL metadata in every ref for everything else);
- :mod:`.cma` — cross-memory attach (``process_vm_readv``) reads;
- :mod:`.nixl_progress` — keeps Ray's NIXL agent from spinning a core.

May import: torch, Ray, NIXL and each other. Never imports the engine or
trainer sides, nor sglang's serving modules.
"""
