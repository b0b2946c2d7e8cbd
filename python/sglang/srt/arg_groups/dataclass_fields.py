"""``dataclasses.fields(ServerArgs)`` for code written when ServerArgs was a dataclass.

sglang 0.5.23 builds ``ServerArgs`` as a msgspec Struct. RL frameworks written
against earlier sglang list its fields the dataclass way — miles rebuilds the
engine's server args in the trainer from ``GET /server_info`` with
``{f.name for f in dataclasses.fields(ServerArgs)}`` and then
``ServerArgs(**filtered)`` — and got ``TypeError: must be called with a
dataclass type or instance``.

:func:`expose_dataclass_fields` gives the class a ``__dataclass_fields__``
mapping (name, type and default of every Struct field), built by
``dataclasses.make_dataclass`` itself, so ``dataclasses.fields`` answers with
the same names in the same order. Nothing else about the class changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def expose_dataclass_fields(cls: Any) -> Any:
    """Give the msgspec Struct ``cls`` the ``__dataclass_fields__`` of a
    dataclass with the same fields (names, annotations, defaults)."""
    import msgspec

    specs = []
    for info in msgspec.structs.fields(cls):
        if info.default is not msgspec.NODEFAULT:
            default = dataclasses.field(default=info.default)
        elif info.default_factory is not msgspec.NODEFAULT:
            default = dataclasses.field(default_factory=info.default_factory)
        else:
            default = dataclasses.field(default=None)
        specs.append((info.name, info.type, default))
    shadow = dataclasses.make_dataclass(f"{cls.__name__}Fields", specs)
    cls.__dataclass_fields__ = shadow.__dataclass_fields__
    return cls
