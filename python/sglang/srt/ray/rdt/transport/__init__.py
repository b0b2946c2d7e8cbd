"""Transports of RDT weight sync: how bytes move between processes.

- :mod:`.same_node`: this process's sender identity, exporter and reader of
  same-node reads, over :mod:`.cuda_ipc` (GPU memory) and :mod:`.cma` (host
  memory: ``process_vm_readv``);
- :mod:`.sglang_ipc`: the ``SGLANG_IPC`` Ray tensor transport;
- :mod:`.metadata`: what a same-node read is given and reports;
- :mod:`.cuda_driver`: the CUDA driver and NVRTC calls; :mod:`.compat`:
  every Ray-private name the package uses.

May import torch, numpy, Ray and each other; never the engine or trainer sides,
nor sglang's serving modules.
"""
