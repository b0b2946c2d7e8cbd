"""``--backend``: a spelling of the process-management backend on the command line.

``--backend ray`` is the same as ``--use-ray``; ``--backend mp`` (the default,
schedulers as local processes) leaves it off. The flag only writes ``use_ray``,
so both spellings produce identical ``ServerArgs``.
"""

from __future__ import annotations

import argparse

# Backend name -> value of ServerArgs.use_ray.
BACKENDS = {"mp": False, "ray": True}


class BackendAction(argparse.Action):
    """Store ``use_ray`` from ``--backend NAME``; unknown names are a clear error."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("metavar", "{" + ",".join(BACKENDS) + "}")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        name = str(values).strip().lower()
        if name not in BACKENDS:
            parser.error(
                f"argument {option_string}: unknown backend {values!r}; "
                f"choose one of {', '.join(sorted(BACKENDS))} "
                "('ray' is the same as --use-ray)"
            )
        if getattr(namespace, self.dest, False) and not BACKENDS[name]:
            parser.error(
                f"argument {option_string}: '--backend {name}' contradicts --use-ray"
            )
        setattr(namespace, self.dest, BACKENDS[name] or getattr(namespace, self.dest))


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        dest="use_ray",
        action=BackendAction,
        default=argparse.SUPPRESS,
        help="How scheduler processes are managed: 'mp' (local processes, the "
        "default) or 'ray' (Ray actors; the same as --use-ray).",
    )
