"""Where each name of ``sglang``'s public API lives.

``sglang/__init__.py`` loads a name from here on first use (PEP 562), so
``import sglang`` — or importing any ``sglang.*`` module, which runs the
package's ``__init__`` first — costs no frontend-language, transformers or
HTTP-client imports. Processes that only need a small part of sglang (a
trainer's bucket sender, a tokenizer-free tool) start in a fraction of the
time; ``sglang.gen`` and friends behave as before.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

_LANG_API = (
    "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function",
    "gen", "gen_int", "gen_string", "get_server_info", "image", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "user", "user_begin", "user_end", "video",
)

EXPORTS: Dict[str, str] = {
    **{name: "sglang.lang.api" for name in _LANG_API},
    "RuntimeEndpoint": "sglang.lang.backend.runtime_endpoint",
    "greedy_token_selection": "sglang.lang.choices",
    "token_length_normalized": "sglang.lang.choices",
    "unconditional_likelihood_normalized": "sglang.lang.choices",
    "global_config": "sglang.lang.global_config",
    "Anthropic": "sglang.lang.backend.anthropic",
    "Crusoe": "sglang.lang.backend.crusoe",
    "LiteLLM": "sglang.lang.backend.litellm",
    "OpenAI": "sglang.lang.backend.openai",
    "VertexAI": "sglang.lang.backend.vertexai",
    "ServerArgs": "sglang.srt.server_args",
    "Engine": "sglang.srt.entrypoints.engine",
}


def load(name: str) -> Any:
    """The object ``sglang.<name>`` stands for (imports its module)."""
    return getattr(importlib.import_module(EXPORTS[name]), name)
