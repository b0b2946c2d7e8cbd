"""Launching the Ray backend from Python: placement group, runtime env, handles.

Two ways to embed an engine in a larger Ray program (an RL framework that owns
the cluster's placement groups):

* ``RayEngine(..., placement_group=pg)`` / the Ray ``launch_server`` inside
  :func:`ray_launch_options` — schedulers go onto the caller's group; no second
  group is created, so resources are not booked twice.
* :func:`launch_engine` — *handles mode*: returns a :class:`LaunchedEngine` with
  the SchedulerActor handles, for a caller that hosts the HTTP server in its
  own Ray actor (``serve_http`` runs it on a thread). Actors are then not
  detached and their names key on the placement group: they die with their
  owner, and callers use the handles instead of names.

The options travel to the launch code in a context variable, not as attributes
patched onto ``ServerArgs``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayLaunchOptions:
    placement_group: Any = None
    runtime_env: Optional[Dict[str, Any]] = None
    handles_mode: bool = False


_OPTIONS: contextvars.ContextVar[RayLaunchOptions] = contextvars.ContextVar(
    "sglang_ray_launch_options", default=RayLaunchOptions()
)


def current_launch_options() -> RayLaunchOptions:
    return _OPTIONS.get()


@contextlib.contextmanager
def ray_launch_options(
    *,
    placement_group: Any = None,
    runtime_env: Optional[Dict[str, Any]] = None,
    handles_mode: bool = False,
) -> Iterator[RayLaunchOptions]:
    """Set the Ray launch options for code run inside the ``with`` block."""
    opts = RayLaunchOptions(placement_group, runtime_env, handles_mode)
    token = _OPTIONS.set(opts)
    try:
        yield opts
    finally:
        _OPTIONS.reset(token)


def resolve_placement_group(explicit=None):
    """(group, is_custom): the explicit one, the context's, or the current one."""
    import ray

    if explicit is not None:
        return explicit, True
    from_ctx = current_launch_options().placement_group
    if from_ctx is not None:
        return from_ctx, True
    return ray.util.get_current_placement_group(), False


@dataclass
class LaunchedEngine:
    """What :func:`launch_engine` started; ``scheduler_actors`` are the handles."""

    server_args: Any
    tokenizer_manager: Any
    template_manager: Any
    port_args: Any
    scheduler_init_result: Any
    subprocess_watchdog: Any
    _http_thread: Optional[threading.Thread] = field(default=None, repr=False)

    @property
    def scheduler_actors(self) -> List[Any]:
        return list(self.scheduler_init_result.scheduler_actors)

    def serve_http(self, block: bool = False) -> Optional[threading.Thread]:
        """Run the HTTP server (also ``/weight_sync/*`` with RDT sync on).

        ``block=False`` runs it on a daemon thread (for a Ray actor that must
        keep answering calls) and returns the thread.
        """
        if block:
            serve_launched(self)
            return None
        self._http_thread = threading.Thread(
            target=serve_launched, args=(self,), daemon=True, name="sglang-http"
        )
        self._http_thread.start()
        return self._http_thread

    def shutdown(self) -> None:
        self.scheduler_init_result.release()


def launch_engine(
    server_args,
    *,
    placement_group=None,
    runtime_env: Optional[Dict[str, Any]] = None,
) -> LaunchedEngine:
    """Start tokenizer, detokenizer and SchedulerActors; return them with handles.

    Example (inside a Ray actor that owns the engine)::

        engine = launch_engine(server_args, placement_group=pg)
        engine.serve_http()                      # HTTP on a thread
        handles = engine.scheduler_actors        # for pull_weights etc.
    """
    from sglang.srt.entrypoints.engine import (
        init_tokenizer_manager,
        run_detokenizer_process,
        run_scheduler_process,
    )
    from sglang.srt.ray.engine import RayEngine

    with ray_launch_options(
        placement_group=placement_group, runtime_env=runtime_env, handles_mode=True
    ):
        (
            tokenizer_manager,
            template_manager,
            port_args,
            scheduler_init_result,
            subprocess_watchdog,
            _weight_cache_daemon_procs,
        ) = RayEngine._launch_subprocesses(
            server_args,
            init_tokenizer_manager_func=init_tokenizer_manager,
            run_scheduler_process_func=run_scheduler_process,
            run_detokenizer_process_func=run_detokenizer_process,
        )
    return LaunchedEngine(
        server_args=server_args,
        tokenizer_manager=tokenizer_manager,
        template_manager=template_manager,
        port_args=port_args,
        scheduler_init_result=scheduler_init_result,
        subprocess_watchdog=subprocess_watchdog,
    )


def serve_launched(launched: LaunchedEngine, execute_warmup_func=None, launch_callback=None) -> None:
    """Run the HTTP server of a launched engine until it stops; then release
    the actors (detached ones included) and the placement group it created."""
    from sglang.srt.entrypoints.http_server import (
        _execute_server_warmup,
        _setup_and_run_http_server,
        app,
    )

    if launched.server_args.enable_rdt_weight_sync:
        from sglang.srt.ray.rdt.http_routes import install_weight_sync_routes
        from sglang.srt.ray.rdt.session import WeightSyncSession

        install_weight_sync_routes(
            app,
            WeightSyncSession(
                launched.tokenizer_manager,
                lambda: launched.scheduler_init_result.scheduler_actors,
            ),
        )
    try:
        _setup_and_run_http_server(
            launched.server_args,
            launched.tokenizer_manager,
            launched.template_manager,
            launched.port_args,
            launched.scheduler_init_result.scheduler_infos,
            launched.subprocess_watchdog,
            execute_warmup_func=execute_warmup_func or _execute_server_warmup,
            launch_callback=launch_callback,
        )
    finally:
        launched.scheduler_init_result.release()
