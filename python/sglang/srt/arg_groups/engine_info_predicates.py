"""Derived decisions about the engine-info bootstrap server.

Engine and model runner decide from these predicates only (exposed as
``ServerArgs.needs_engine_info_bootstrap()`` / ``registers_parallelism_config()``),
so a new reason to run the server is one line here, not an ``if`` in launch code.
``cfg`` is anything with the fields: a resolving view of ServerArgs, or a bag.
Flags that imply ``enable_engine_info_bootstrap`` (``--enable-rdt-weight-sync``)
declare it during resolution (``sglang/srt/ray/rdt/plugin.py``), so the field
itself says whether the server runs.
"""

from __future__ import annotations

from typing import Any


def registers_parallelism_config_of(cfg: Any) -> bool:
    """Every rank registers its parallelism config with the bootstrap server."""
    return bool(getattr(cfg, "enable_engine_info_bootstrap", False))


def needs_engine_info_bootstrap_of(cfg: Any) -> bool:
    """Node rank 0 runs the engine-info bootstrap server."""
    return bool(
        getattr(cfg, "remote_instance_weight_loader_start_seed_via_transfer_engine", False)
        or registers_parallelism_config_of(cfg)
    )
