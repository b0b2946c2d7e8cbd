"""Start-up checks of the Ray backend flags (importable without ray)."""

from __future__ import annotations


def check_weight_sync_args(server_args) -> None:
    """Checks of the Ray backend's own flags (run from ServerArgs.check_server_args)."""
    if getattr(server_args, "ray_placement_strategy", None) and not server_args.use_ray:
        raise ValueError("--ray-placement-strategy needs the Ray backend: add --backend ray")
    if not getattr(server_args, "enable_rdt_weight_sync", False):
        return
    if not server_args.use_ray:
        raise ValueError(
            "--enable-rdt-weight-sync needs the Ray backend: add --backend ray "
            "(or --use-ray)"
        )
    try:
        import nixl  # noqa: F401
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:
        raise ValueError(
            "--enable-rdt-weight-sync needs NIXL, which cannot be imported here "
            f"({type(e).__name__}: {e}). Install the variant that matches torch's "
            "CUDA major, e.g. for sglang 0.5.23 (torch cu130): "
            "pip install nixl-cu13==1.5.1 && pip install --no-deps nixl==1.5.1"
        ) from e
    if getattr(server_args, "rdt_pull_timeout", 1) <= 0:
        raise ValueError("--rdt-pull-timeout must be positive")
