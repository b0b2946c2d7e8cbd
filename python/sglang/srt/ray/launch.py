"""Launching the Ray backend from Python: placement group, runtime env, handles.

Two ways to embed an engine in a larger Ray program (an RL framework that owns
the cluster's placement groups):

* ``RayEngine(..., placement_group=pg)`` / the Ray ``launch_server`` inside
  :func:`ray_launch_options` — schedulers go onto the caller's group; no second
  group is created, so resources are not booked twice.
* :func:`launch_engine` — *handles mode*: returns a :class:`LaunchedEngine`
  (the seed API's 5-tuple) with the SchedulerActor handles, for a caller that
  hosts the HTTP server in its own Ray actor (``serve_http(engine,
  server_args)`` on a thread). Both are importable from
  ``sglang.srt.ray.http_server``, where miles imports them. Actors are then not
  detached and their names key on the placement group: they die with their
  owner, and callers use the handles instead of names.

The options travel to the launch code in a context variable, not as attributes
patched onto ``ServerArgs``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

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


class LaunchedEngine(NamedTuple):
    """What :func:`launch_engine` started: the 5-tuple of the seed API.

    ``tokenizer_manager, template_manager, port_args, scheduler_init_result,
    subprocess_watchdog = engine``; the SchedulerActor handles are
    ``scheduler_init_result.scheduler_actors`` (also :attr:`scheduler_actors`),
    in rank order.
    """

    tokenizer_manager: Any
    template_manager: Any
    port_args: Any
    scheduler_init_result: Any
    subprocess_watchdog: Any

    @property
    def scheduler_actors(self) -> List[Any]:
        return list(self.scheduler_init_result.scheduler_actors)

    def shutdown(self) -> None:
        self.scheduler_init_result.release()


def launch_engine(
    server_args,
    *,
    placement_group=None,
    runtime_env: Optional[Dict[str, Any]] = None,
) -> LaunchedEngine:
    """Start tokenizer, detokenizer and SchedulerActors; return them with handles.

    Example (inside a Ray actor that owns the engine; what miles does)::

        from sglang.srt.ray.http_server import launch_engine, serve_http

        engine = launch_engine(server_args, placement_group=pg)
        _, _, _, scheduler_init_result, _ = engine
        handles = scheduler_init_result.scheduler_actors   # for pull_weights
        threading.Thread(target=serve_http, args=(engine, server_args),
                         daemon=True).start()
    """
    return start_engine(
        server_args,
        placement_group=placement_group,
        runtime_env=runtime_env,
        handles_mode=True,
    )


def start_engine(
    server_args,
    *,
    placement_group=None,
    runtime_env: Optional[Dict[str, Any]] = None,
    handles_mode: bool = False,
    init_tokenizer_manager_func=None,
    run_scheduler_process_func=None,
    run_detokenizer_process_func=None,
) -> LaunchedEngine:
    """Start tokenizer, detokenizer and SchedulerActors under the given Ray
    launch options (:func:`launch_engine` and the Ray ``launch_server``)."""
    from sglang.srt.entrypoints import engine as entry
    from sglang.srt.plugins import load_plugins
    from sglang.srt.ray.engine import RayEngine

    # As the CLI and Engine() do: the plugins' resolution hooks (the fork's
    # flag rules among them) must be registered before server_args resolves.
    load_plugins()
    with ray_launch_options(
        placement_group=placement_group, runtime_env=runtime_env, handles_mode=handles_mode
    ):
        started = RayEngine._launch_subprocesses(
            server_args,
            init_tokenizer_manager_func=init_tokenizer_manager_func
            or entry.init_tokenizer_manager,
            run_scheduler_process_func=run_scheduler_process_func
            or entry.run_scheduler_process,
            run_detokenizer_process_func=run_detokenizer_process_func
            or entry.run_detokenizer_process,
        )
    # The sixth item (weight-cache daemon processes) is not used by Ray.
    return LaunchedEngine(*started[:5])


def serve_http(
    engine: LaunchedEngine, server_args, execute_warmup_func=None, launch_callback=None
) -> None:
    """Run the HTTP server of a launched engine until it stops (blocking; may
    run on a thread other than the main one); then release the actors
    (detached ones included) and the placement group it created."""
    launched = LaunchedEngine(*engine)
    from sglang.srt.entrypoints.http_server import (
        _execute_server_warmup,
        _setup_and_run_http_server,
        app,
    )

    if server_args.enable_rdt_weight_sync:
        from sglang.srt.ray.rdt.engine.http_routes import install_weight_sync_routes

        install_weight_sync_routes(app, server_args, launched)
    try:
        _setup_and_run_http_server(
            server_args,
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
