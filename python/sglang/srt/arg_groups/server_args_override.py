"""``ServerArgs.override(reason, **fields)`` and the server-args argument of the
``initialize_*_config`` functions.

A process that is not an engine (a trainer building a model replica of one
engine rank) starts from the engine's server args and changes a few of them for
its own purpose, e.g. ``nnodes=1`` because its replica is local. Where it does
that decides how the change must be made:

* before resolution (a record fresh from ``ServerArgs(...)``), the raw fields
  are still open: they are assigned, and resolution then sees them as input;
* after resolution but before publication, the raw record is sealed: the change
  is declared as a resolution decision (``declare_resolution``), which the
  config bags pick up when the record is published;
* on the published record, it goes to the live config bags
  (``get_context().override``), which also log it.

In every case ``reason`` is recorded on the record itself, in
``override_log(server_args)``, and travels with it when pickled.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple

__all__ = [
    "OverrideRecord",
    "override_log",
    "override_server_args",
    "publish_for",
]

_LOG_ATTR = "_caller_overrides"


class OverrideRecord(NamedTuple):
    reason: str
    fields: Dict[str, Any]
    # "input" (raw field, before resolution), "declared" (resolved, not yet
    # published) or "published" (live config bags).
    stage: str


def _published_record():
    from sglang.srt.runtime_context import get_context

    try:
        return get_context().server_args
    except ValueError:
        return None


def override_server_args(server_args, reason: str, **fields: Any):
    """Change ``fields`` of ``server_args`` for ``reason``; returns ``server_args``."""
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(
            "ServerArgs.override(reason, **fields): reason must be a non-empty string "
            f"saying who changes the fields and why, got {reason!r}"
        )
    if not fields:
        raise ValueError(f"ServerArgs.override({reason!r}): no fields given")
    from sglang.srt.arg_groups.arg_utils import field_names

    unknown = sorted(set(fields) - set(field_names(type(server_args))))
    if unknown:
        raise ValueError(
            f"ServerArgs.override({reason!r}): {unknown} are not ServerArgs fields"
        )

    if _published_record() is server_args:
        from sglang.srt.runtime_context import get_context

        get_context().override(reason, **fields)
        stage = "published"
    elif getattr(server_args, "_resolution_finished", False):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, reason, **fields)
        stage = "declared"
    elif getattr(server_args, "_input_frozen", False):
        raise RuntimeError(
            f"ServerArgs.override({reason!r}) during resolution: resolution handlers "
            "declare their decisions with declare_resolution(server_args, source, ...)"
        )
    else:
        for name, value in fields.items():
            setattr(server_args, name, value)
        stage = "input"

    log = getattr(server_args, _LOG_ATTR, None)
    if log is None:
        log = []
        setattr(server_args, _LOG_ATTR, log)
    log.append(OverrideRecord(reason, dict(fields), stage))
    return server_args


def override_log(server_args) -> List[OverrideRecord]:
    """The ``ServerArgs.override`` calls made on ``server_args``, oldest first."""
    return list(getattr(server_args, _LOG_ATTR, None) or ())


def publish_for(server_args, caller: str) -> None:
    """Make ``server_args`` the configuration ``caller`` reads.

    ``None``: read what is published. The published record itself: nothing to
    do. Nothing published yet: publish ``server_args`` (role ``scheduler``, as
    ``set_global_server_args_for_scheduler`` does). Another record published:
    refuse, rather than silently replace the process's configuration.
    """
    if server_args is None:
        return
    published = _published_record()
    if published is server_args:
        return
    if published is None:
        from sglang.srt.runtime_context import publish

        publish(server_args, role="scheduler")
        return
    raise ValueError(
        f"{caller}(server_args): another ServerArgs is published in this process; "
        "publish this one first (set_global_server_args_for_scheduler(server_args)) "
        f"or call {caller}() to use the published one"
    )

