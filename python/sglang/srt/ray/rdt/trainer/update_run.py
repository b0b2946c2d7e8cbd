"""One :meth:`WeightSyncClient.update`, start to end.

Check the tensors against every rank's layout (nothing moves before), pick
the path — the ranks read the trainer's own tensors (:mod:`.direct`) or the
double-buffered bucket pipeline (:mod:`.pipeline`) — open the engine's
session as late as possible, end it, and on any failure wait for pulls still
reading and abort what the failure left open.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from sglang.srt.ray.rdt.defaults import PULL_TIMEOUT_S, PULL_WAIT_MARGIN_S
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError
from sglang.srt.ray.rdt.trainer import direct
from sglang.srt.ray.rdt.trainer.buckets import plan_steps
from sglang.srt.ray.rdt.trainer.payloads import signature, split_payloads
from sglang.srt.ray.rdt.trainer.pipeline import PipelineRun
from sglang.srt.ray.rdt.trainer.stats import UpdateStats

logger = logging.getLogger(__name__)


def run_update(client, named_tensors, version: Optional[str], bucket_bytes: Optional[int],
               strict: bool, flush_cache: bool, progress) -> UpdateStats:
    t_call = time.perf_counter()
    version = None if version is None else str(version)
    payloads, groups = split_payloads(named_tensors, len(client.ranks))
    # One pass over the tensors; equal to the last update's: the same objects.
    sigs = client._signatures.intern([signature(payloads[g[0]]) for g in groups])
    items_per_group = client._checked.items_per_group(
        payloads, groups, client.parameter_layouts(), [r.label() for r in client.ranks], strict,
        sigs,
    )
    wait_s = (client.pull_timeout_s or PULL_TIMEOUT_S) + PULL_WAIT_MARGIN_S
    blocker = direct.client_blocker(client) or client._in_place.blocker(
        [payloads[g[0]] for g in groups], client.device, sigs)
    if blocker is not None and client.export == "direct":
        raise WeightSyncError(f"export='direct': the ranks cannot read this trainer's "
                              f"tensors in place ({blocker}); nothing was sent")
    # One pull per rank: against a paused engine it ends the update too.
    fold = blocker is None and client.session.folds_finalize
    steps = []
    if blocker is not None:
        logger.debug("[RDT] update through buckets: %s", blocker)
        steps, buffer_bytes = plan_steps(items_per_group, bucket_bytes or client.bucket_bytes)
        client.pipeline.reclaim_stuck()
        client.sender.prepare(buffer_bytes, client.ranks)
        if client.sender.local:
            direct.open_lanes(client)  # the buckets' refs are this process's
    run = PipelineRun(steps)
    t_end = 0.0
    try:
        if blocker is None:
            client._direct_used = True
            direct.open_lanes(client)
            direct.run_direct(
                client.ranks, payloads, groups, run, put=direct.put_direct,
                refs_cache=client._direct_refs, gather=client._gather,
                open_session=client.session.begin, pull_timeout=client.pull_timeout_s,
                wait_s=wait_s,
                finalize={"weight_version": version, "flush_cache": flush_cache} if fold else None,
                lanes=client.lanes, sigs=sigs,
            )
        else:
            client.pipeline.run(
                steps, payloads, groups, pull_timeout=client.pull_timeout_s, wait_s=wait_s,
                open_session=client.session.begin, progress=progress, run=run,
            )
        if not fold:
            t0 = time.perf_counter()
            client.session.end(run.session_id, version, flush_cache)
            t_end = time.perf_counter() - t0
    except BaseException as e:
        client.pipeline.settle(run, wait_s)
        if run.session_open:
            _abort(client, run, e, fold)
        raise
    finally:
        if run.session_open:  # the ranks ended (or aborted) an update: as they do, let go
            client.lanes.update_ended()  # of the refs it did not read

    client.updates += 1
    stats = UpdateStats.of(run, steps, groups, version, len(client.ranks),
                           time.perf_counter() - t_call, t_end)
    logger.info("[RDT] update: %s", stats.summary())
    return stats


def _abort(client, run: PipelineRun, e: BaseException, fold: bool) -> None:
    """Abort the engine's session after ``e``; say on ``e`` if that failed too."""
    reason = f"weight-sync client: {type(e).__name__}: {str(e)[:300]}"
    try:
        if fold and isinstance(e, WeightSyncRankError):
            # The ranks whose pull returned ended the update whole.
            client.session.abort(run.session_id, reason, only=sorted({r for r, _ in e.failures}))
        else:
            client.session.abort(run.session_id, reason)
        if isinstance(e, WeightSyncRankError):
            e.aborted = True
    except Exception as abort_error:
        logger.error("[RDT] aborting the engine's update session failed: %s", abort_error)
        e.add_note(f"aborting the engine's update session failed too: {abort_error}")
