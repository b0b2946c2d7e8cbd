"""Prometheus metrics of RDT weight sync on a rank (``--enable-metrics``), labelled dp/pp/tp rank.

Off until :func:`configure`, then beside sglang's scheduler metrics (:func:`default_backend`); ``record_*`` never raise.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Mapping, Optional, Tuple

logger = logging.getLogger(__name__)

# From a 1 MiB CPU pull (~1 ms) to a cross-node update of a large model (many seconds).
SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
FAILURE_KINDS = ("rejected", "conflict", "transfer", "finalize", "abort", "other")


def _sglang_uses_ray_collectors() -> bool:
    """Whether sglang's collectors here are the Ray-backed ones (``RayEngine(enable_metrics=True)``)."""
    try:
        from sglang.srt.runtime_context import get_observability

        loggers = get_observability().stat_loggers or {}
    except Exception:
        return False
    return any("ray_wrappers" in getattr(c, "__module__", "") for c in loggers.values())


def default_backend() -> str:
    """``prometheus`` (multiprocess files the server's ``/metrics`` reads) or ``ray`` (``ray_`` prefix)."""
    if _sglang_uses_ray_collectors():
        return "ray"
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return "prometheus" if d and os.path.isdir(d) else "ray"


def metric_factories(backend: str) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """(counter, histogram) classes with prometheus_client's signature."""
    if backend == "prometheus":
        from prometheus_client import Counter, Histogram

        return Counter, Histogram
    if backend == "ray":
        from sglang.srt.observability.ray_wrappers import RayCounterWrapper, RayHistogramWrapper

        return RayCounterWrapper, RayHistogramWrapper
    raise ValueError(f"unknown metrics backend {backend!r}; use 'prometheus' or 'ray'")


class RdtMetrics:
    """The metric set of one process; ``counter``/``histogram`` default to :func:`default_backend`'s."""

    def __init__(self, labels: Optional[Mapping[str, Any]] = None, *, counter: Optional[Callable[..., Any]] = None,
                 histogram: Optional[Callable[..., Any]] = None):
        if counter is None or histogram is None:
            self.backend = default_backend()
            counter, histogram = metric_factories(self.backend)
        else:
            self.backend = "custom"
        self._labels = {k: str(v) for k, v in (labels or {}).items()}
        names = list(self._labels)

        def c(name, doc, extra=()):
            return counter(name=name, documentation=doc, labelnames=names + list(extra))

        def h(name, doc):
            return histogram(name=name, documentation=doc, labelnames=names, buckets=SECONDS_BUCKETS)

        self.pulls = c("sglang:rdt_weight_pulls", "RDT weight pulls that completed")
        self.pull_bytes = c("sglang:rdt_weight_pull_bytes", "Bytes written into live parameters by RDT pulls")
        self.pull_tensors = c("sglang:rdt_weight_pull_tensors", "Tensors written into live parameters by RDT pulls")
        self.pull_seconds = h("sglang:rdt_weight_pull_seconds", "Seconds per RDT pull (plan + transfer)")
        self.updates = c("sglang:rdt_weight_updates", "RDT weight updates finalized")
        self.update_seconds = h("sglang:rdt_weight_update_seconds",
                                "Seconds from the first pull (or session begin) of an update to its finalize")
        self.failures = c("sglang:rdt_weight_sync_failures", "RDT weight-sync failures by kind", ("kind",))
        self.lora_updates = c("sglang:rdt_lora_adapter_updates", "LoRA adapters served by RDT updates", ("adapter",))
        self.lora_bytes = c("sglang:rdt_lora_adapter_bytes", "Bytes of LoRA adapters served by RDT updates",
                            ("adapter",))

    def _l(self, metric, **extra):
        return metric.labels(**self._labels, **extra) if (self._labels or extra) else metric

    def record_pull(self, stats: Mapping[str, Any]) -> None:
        self._l(self.pulls).inc(1)
        self._l(self.pull_bytes).inc(float(stats.get("bytes", 0)))
        self._l(self.pull_tensors).inc(float(stats.get("tensors", 0)))
        self._l(self.pull_seconds).observe(float(stats["seconds"]))

    def record_update(self, seconds: float, adapters: Optional[Mapping[str, int]] = None) -> None:
        self._l(self.updates).inc(1)
        self._l(self.update_seconds).observe(float(seconds))
        for name, nbytes in (adapters or {}).items():
            self._l(self.lora_updates, adapter=name).inc(1)
            self._l(self.lora_bytes, adapter=name).inc(float(nbytes))

    def record_failure(self, kind: str) -> None:
        self._l(self.failures, kind=kind if kind in FAILURE_KINDS else "other").inc(1)


_lock = threading.Lock()  # guards the process-wide metrics instance
_metrics: Optional[RdtMetrics] = None


def configure(enabled: bool, labels: Optional[Mapping[str, Any]] = None, **factories) -> Optional[RdtMetrics]:
    """Turn this process's metrics on or off (``labels`` on every sample); failing to create them leaves them off."""
    global _metrics
    with _lock:
        if not enabled:
            _metrics = None
            return None
        try:
            _metrics = RdtMetrics(labels, **factories)
            logger.info("[RDT] weight-sync metrics on (%s backend, labels %s)", _metrics.backend, dict(labels or {}))
        except Exception as e:
            logger.warning("[RDT] weight-sync metrics disabled: %s: %s", type(e).__name__, e)
            _metrics = None
        return _metrics


def enabled() -> bool:
    return _metrics is not None


def _safe(fn_name: str, *args) -> None:
    m = _metrics
    if m is None:
        return
    try:
        getattr(m, fn_name)(*args)
    except Exception as e:  # pragma: no cover - never let metrics break a pull
        logger.debug("[RDT] metric %s failed: %s", fn_name, e)


def record_pull(stats: Mapping[str, Any]) -> None:
    """Count one completed pull (the stats dict ``pull_weights`` returns)."""
    _safe("record_pull", stats)


def record_update(seconds: float, adapters: Optional[Mapping[str, int]] = None) -> None:
    """Count one finalized update (``seconds``: its duration on this rank; ``adapters``: LoRA name -> bytes served)."""
    _safe("record_update", seconds, adapters)


def record_failure(kind: str) -> None:
    """Count a failure: ``"rejected"``, ``"transfer"``, ``"finalize"``, ``"abort"``."""
    _safe("record_failure", kind)
