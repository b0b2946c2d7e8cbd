"""Extra sections of ``GET /server_info`` contributed by optional features.

A feature registers an async provider once (e.g. weight sync adds
``"weight_sync": {...}`` with the engine's weight consistency); ``/server_info``
merges every provider's section. A failing provider reports its error in its
own section instead of breaking the endpoint.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict

_PROVIDERS: Dict[str, Callable[[], Awaitable[Any]]] = {}


def register_server_info_provider(name: str, provider: Callable[[], Awaitable[Any]]) -> None:
    _PROVIDERS[name] = provider


async def collect_server_info_extras() -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, provider in list(_PROVIDERS.items()):
        try:
            out[name] = await provider()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out
