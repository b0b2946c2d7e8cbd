"""Keep NIXL's UCX progress thread from spinning a CPU core in every RDT process.

Ray builds each process's NIXL agent with the defaults of nixl's Python API,
which start the UCX backend's progress thread with a poll delay of 0. That
thread then never sleeps: ``poll(fds, 0)`` returns at once and it loops, using a
whole core for as long as the process lives — in every process that ever
touched NIXL (a SchedulerActor after ``register_weight_for_rdt``, a trainer
actor after one ``ray.put(..., _tensor_transport="nixl")``, a driver). On a
rollout node that is one core per rank taken from tokenization and scheduling;
on a small CPU box it starves everything else.

The thread still wakes on UCX events (its worker's event fd); the delay only
bounds how long it sleeps when none come, so a delay of a millisecond or more
costs no transfer speed (``benchmark/rdt_weight_sync/bench_pull.py`` shows
both). :func:`configure_nixl_progress_thread` makes Ray build the agent with
that delay. It must run in the process before the agent exists (the first
registration or NIXL put); the receiver, the bucket sender, the same-node
transport and the SchedulerActor call it. Any process that imports the
fork's ``sglang`` (a trainer that builds its rollout-layout replica with
sglang's loaders, as miles does) gets it too: :func:`configure_on_ray_import`
runs at ``import sglang`` and applies it as soon as Ray's NIXL transport module
is loaded, without importing Ray itself.

``SGLANG_RDT_NIXL_PROGRESS_DELAY_US`` sets the delay (default 1000; ``0`` leaves
NIXL's own setting). This module imports neither sglang nor torch, so a
trainer process can load it on its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from typing import Iterator, Optional

from sglang.srt.ray.rdt.transport import compat

logger = logging.getLogger(__name__)

DELAY_ENV = "SGLANG_RDT_NIXL_PROGRESS_DELAY_US"

_lock = threading.RLock()
_delay_us: Optional[int] = None  # what new agents get; None: NIXL's default
_installed = False
_agent_delay_us: Optional[int] = None  # the delay the agent was made with


def progress_delay_us() -> int:
    """The delay asked for by the environment (microseconds, 0 = NIXL's)."""
    from sglang.srt.environ import envs

    value = envs.SGLANG_RDT_NIXL_PROGRESS_DELAY_US.get()
    if value < 0:
        raise ValueError(f"{DELAY_ENV} must be >= 0, got {value}")
    return value


@contextlib.contextmanager
def _agent_config_delay(delay_us: int) -> Iterator[None]:
    """While active, NIXL agents built by nixl's ``nixl_agent`` get
    ``pthrDelay = delay_us`` (nixl's constructor sets 0 on a config object it
    builds itself; it is given one whose ``pthrDelay`` has a floor)."""
    api = compat.nixl_api_module()
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    if "pthrDelay" not in dir(base):
        logger.warning("[RDT] this NIXL has no pthrDelay setting; its progress thread keeps NIXL's polling")
        yield
        return

    class _Config(base):
        def __setattr__(self, name, value):
            if name == "pthrDelay":
                value = max(int(value), delay_us)
            super().__setattr__(name, value)

    shim = types.ModuleType(bind.__name__)
    shim.__dict__.update({k: v for k, v in vars(bind).items() if not k.startswith("__")})
    shim.nixlAgentConfig = _Config
    with _lock:
        api.nixlBind = shim
        try:
            yield
        finally:
            api.nixlBind = bind


_warned_existing = False


def agent_created() -> bool:
    """Whether this process's Ray NIXL agent exists already (without creating
    Ray's NIXL transport manager when there is none)."""
    return compat.ray_nixl_agent_exists()


def configure_nixl_progress_thread(delay_us: Optional[int] = None) -> Optional[int]:
    """Make the NIXL agent Ray creates in this process poll with ``delay_us``.

    Idempotent; the last call wins for agents not created yet. Returns the
    delay in effect, or None when NIXL's own setting is kept (``delay_us`` or
    the environment says 0, or this Ray has no hook for it). An agent that
    already exists keeps its thread; that is logged.
    """
    global _delay_us, _installed
    delay = progress_delay_us() if delay_us is None else int(delay_us)
    if delay < 0:
        raise ValueError(f"delay_us must be >= 0, got {delay}")
    if compat.ray_nixl_transport_class() is None:  # Ray without RDT: nothing creates agents
        return None
    with _lock:
        _delay_us = delay or None
        if not _installed:

            def wrap(original):
                def _make_nixl_agent(self, backend):
                    global _agent_delay_us
                    delay_now = _delay_us
                    if delay_now is None:
                        return original(self, backend)
                    with _agent_config_delay(delay_now):
                        agent = original(self, backend)
                    _agent_delay_us = delay_now
                    return agent

                return _make_nixl_agent

            if not compat.wrap_ray_nixl_agent_factory(wrap):
                logger.warning("[RDT] this Ray builds NIXL agents without _make_nixl_agent; "
                               "the progress-thread delay is not applied")
                return None
            _installed = True
    global _warned_existing
    if (_delay_us is not None and _agent_delay_us is None and not _warned_existing
            and agent_created()):
        # Said once: callers on hot paths (every transport lookup) land here too.
        _warned_existing = True
        logger.warning("[RDT] the NIXL agent of this process exists already; its progress thread "
                       "keeps polling without a delay (call configure_nixl_progress_thread earlier)")
    return _delay_us


def describe() -> str:
    """How this process's NIXL progress thread polls (for status and logs)."""
    if not agent_created():
        return "no NIXL agent yet"
    if _agent_delay_us:
        return f"sleeps up to {_agent_delay_us} us between UCX events"
    return "busy-polls (NIXL default)"




def _configure_quietly() -> None:
    try:
        configure_nixl_progress_thread()
    except Exception as e:  # a bad env value: say so, never break an import
        logger.warning("[RDT] NIXL progress-thread delay not applied: %s", e)


def configure_on_ray_import() -> None:
    """Apply :func:`configure_nixl_progress_thread` in this process now if
    Ray's NIXL transport is loaded, else as soon as it is (cheap; imports nothing)."""
    from sglang._import_hooks import call_after_import

    call_after_import(compat.RAY_NIXL_MODULE, _configure_quietly)
