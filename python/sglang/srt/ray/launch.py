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
import socket
import time
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


def reserve_http_port(server_args) -> socket.socket:
    """Bind the HTTP server's ``--host``/``--port`` now, before anything is
    launched, and hold it until :func:`serve_http` hands it to uvicorn: a
    port that cannot be bound fails here, in seconds, with nothing started;
    and no socket made while the engine starts (a rank's process group
    picks free ports) can take it meanwhile."""
    host, port = server_args.host or "0.0.0.0", server_args.port
    try:
        family = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own bind)
        sock.bind((host, port))
    except OSError as e:
        raise RuntimeError(f"--port {port}: the HTTP server cannot bind {host}:{port} "
                           f"({e.strerror or e}); choose another --port or stop the process "
                           "using it") from None
    return sock


def serve_http(
    engine: LaunchedEngine, server_args, execute_warmup_func=None, launch_callback=None,
    reserved_port: Optional[socket.socket] = None,
) -> None:
    """Run the HTTP server of a launched engine until it stops (blocking; may
    run on a thread other than the main one); then release the actors
    (detached ones included) and the placement group it created.
    ``reserved_port``: the port's socket :func:`reserve_http_port` holds,
    let go right before uvicorn binds. A server that never listens (the
    port was taken after all) shuts the engine down and raises, naming it."""
    launched = LaunchedEngine(*engine)
    from sglang.srt.entrypoints.http_server import (
        _execute_server_warmup,
        _setup_and_run_http_server,
        app,
    )

    if server_args.enable_rdt_weight_sync:
        from sglang.srt.ray.rdt.engine.http_routes import install_weight_sync_routes

        install_weight_sync_routes(app, server_args, launched)
    warmup, never_listened = execute_warmup_func or _execute_server_warmup, []

    def warmup_once_listening(args) -> bool:
        # sglang's warmup polls the port for two minutes, and a server whose
        # bind failed waits for it before it exits: go on only once this
        # process listens there.
        deadline = time.monotonic() + LISTEN_WAIT_S
        while not _listening(args.port):
            if time.monotonic() > deadline:
                never_listened.append(True)
                logger.error("the HTTP server never listened on port %s (--port); shutting the "
                             "engine down", args.port)
                return False
            time.sleep(0.1)
        return warmup(args)

    try:
        if reserved_port is not None:
            reserved_port.close()
        _setup_and_run_http_server(
            server_args,
            launched.tokenizer_manager,
            launched.template_manager,
            launched.port_args,
            launched.scheduler_init_result.scheduler_infos,
            launched.subprocess_watchdog,
            execute_warmup_func=warmup_once_listening,
            launch_callback=launch_callback,
        )
    except SystemExit:
        if never_listened:
            raise RuntimeError(f"--port {server_args.port}: the HTTP server could not bind "
                               f"{server_args.host}:{server_args.port}; the engine was shut down. "
                               "Choose another --port or stop the process using it.") from None
        raise
    finally:
        if launched.subprocess_watchdog is not None:
            launched.subprocess_watchdog.stop()  # (the engine goes down on purpose)
        launched.scheduler_init_result.release()


# How long the HTTP server may take to listen once the engine is up.
LISTEN_WAIT_S = 30.0


def _listening(port: int) -> bool:
    """Whether this process has a listening TCP socket on ``port``."""
    import psutil

    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in psutil.Process().net_connections("tcp"))
