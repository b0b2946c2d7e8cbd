"""Run a function right after a module is imported — or now, if it already is.

For set-up that belongs to a library but must not import it: ``import
sglang`` arranges the transformers patches and the NIXL progress-thread
delay this way, so a process that never loads transformers or Ray's NIXL
transport pays for neither. Imports nothing but the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from typing import Callable, Dict, List

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: Dict[str, List[Callable[[], None]]] = {}


def _run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # never break the import that triggered it
        logger.warning("set-up after importing %s failed: %s: %s", name, type(e).__name__, e)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a watched module so the callbacks run right after
    the module's code has executed."""

    def find_spec(self, name, path, target=None):
        with _lock:
            if name not in _pending:
                return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            with _lock:
                callbacks = _pending.pop(name, [])
            for fn in callbacks:
                _run(name, fn)

        spec.loader.exec_module = exec_then_call
        return spec


_finder = _AfterImportFinder()


def call_after_import(module_name: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once ``module_name`` is imported (now if it is loaded).
    Errors are logged, never raised into the importer."""
    if module_name in sys.modules:
        _run(module_name, fn)
        return
    with _lock:
        _pending.setdefault(module_name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
