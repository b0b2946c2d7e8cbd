"""Call every rank and wait: the one fan-out of weight sync, one error naming the ranks that failed."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang.srt.ray.rdt.errors import WeightSyncRankError, unwrap

RANK_CALL_TIMEOUT_S = 300.0  # how long a control call on a rank (status, begin, finalize) may take


def gather(calls: Sequence[Tuple[int, Any]], phase: str, timeout_s: float,
           name_of: Callable[[int], Optional[str]] = lambda rank: None) -> Dict[int, Any]:
    """Wait for ``[(rank, call)]`` (ObjectRefs, or lane calls with ``result(timeout_s)``) within ``timeout_s``;
    one :class:`WeightSyncRankError` naming every rank that failed or timed out."""
    import ray

    deadline = time.monotonic() + timeout_s
    refs = [ref for _, ref in calls if isinstance(ref, ray.ObjectRef)]
    pending = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[1]) if refs else set()
    results, failures = {}, []
    for rank, ref in calls:
        try:
            if not isinstance(ref, ray.ObjectRef):
                results[rank] = ref.result(max(0.0, deadline - time.monotonic()))
            elif ref in pending:
                failures.append((rank, TimeoutError(f"no answer within {timeout_s:.0f} s (is its scheduler stuck?)")))
            else:
                results[rank] = ray.get(ref)
        except Exception as e:
            failures.append((rank, unwrap(e)))
    if failures:
        rank, cause = failures[0]
        raise WeightSyncRankError(rank, name_of(rank), phase, cause, failures)
    return results


def settle(calls: Sequence[Tuple[int, Any]], timeout_s: float) -> None:
    """Wait (bounded, results ignored) until every call of ``[(rank, call)]`` has finished."""
    import ray

    deadline = time.monotonic() + timeout_s
    refs = [ref for _, ref in calls if isinstance(ref, ray.ObjectRef)]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for _, call in calls:
        if not isinstance(call, ray.ObjectRef):
            call.wait(max(0.0, deadline - time.monotonic()))


def unfinished(calls: Sequence[Tuple[int, Any]]) -> List[Any]:
    """The calls of ``[(rank, call)]`` that have not finished yet (no waiting)."""
    import ray

    refs = [ref for _, ref in calls if isinstance(ref, ray.ObjectRef)]
    out = list(ray.wait(refs, num_returns=len(refs), timeout=0)[1]) if refs else []
    return out + [c for _, c in calls if not isinstance(c, ray.ObjectRef) and not c.finished()]


async def call_ranks_async(actors: Sequence[Any], method: str, *args,
                           timeout_s: float = RANK_CALL_TIMEOUT_S) -> List[Any]:
    """``actor.method(*args)`` on every actor, awaited on a worker thread; results in the actors' order."""
    if not actors:
        raise WeightSyncRankError(0, None, method, RuntimeError("no scheduler actors"), [])

    def call() -> List[Any]:
        out = gather([(i, getattr(a, method).remote(*args)) for i, a in enumerate(actors)], method, timeout_s)
        return [out[i] for i in range(len(actors))]

    return await asyncio.get_running_loop().run_in_executor(None, call)
