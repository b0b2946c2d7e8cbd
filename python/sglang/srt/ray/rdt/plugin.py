"""The fork's sglang plugin (entry point ``sglang.srt.plugins``: ``ray_rdt_weight_sync``), run before ServerArgs
resolve: ``--enable-rdt-weight-sync`` implies ``--enable-engine-info-bootstrap`` (trainers read
``/parallelism_config?rank=R``), declared as a resolution hook.
"""

from __future__ import annotations

import functools


def rdt_implies_engine_info_bootstrap(server_args, previous) -> None:
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    previous(server_args)
    cfg = resolving_view(server_args)
    if getattr(cfg, "enable_rdt_weight_sync", False) and not cfg.enable_engine_info_bootstrap:
        declare_resolution(server_args, "--enable-rdt-weight-sync", enable_engine_info_bootstrap=True)


@functools.cache
def register() -> None:
    """Register the hooks (idempotent: cached; sglang calls it once per process)."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_other_validations")(rdt_implies_engine_info_bootstrap)
