"""The engine's update session (rdt/engine/session.py): a drain and a lease
around sglang's own lifecycle calls, against a stand-in tokenizer manager
that holds sglang's real model-update lock."""

from __future__ import annotations

import asyncio
import types

import pytest

from sglang.srt.ray.rdt.engine.session import WeightSyncSession
from sglang.srt.ray.rdt.errors import WeightSyncSessionError
from sglang.srt.utils.aio_rwlock import RWLock


class StandInTokenizerManager:
    """What the session calls on sglang's tokenizer manager, recorded."""

    def __init__(self, end_problem=None, paused=False):
        self.model_update_lock = RWLock()
        self.calls = []
        self.end_problem = end_problem
        self.is_pause = paused
        self.is_pause_cond = asyncio.Condition()

    async def pause_generation(self, obj):
        self.calls.append(f"pause {obj.mode}")
        self.is_pause = True

    async def continue_generation(self, obj):
        self.calls.append("continue")
        self.is_pause = False

    async def begin_weight_update_communicator(self, obj):
        self.calls.append("begin")
        return [types.SimpleNamespace(success=True, message="")]

    async def end_weight_update_communicator(self, obj):
        self.calls.append(f"abort: {obj.abort_reason}" if obj.abort else "end")
        ok = self.end_problem is None
        return [types.SimpleNamespace(success=ok, message=self.end_problem or "")]

    async def update_weight_version(self, obj):
        self.calls.append(f"version {obj.new_version}")

    async def flush_cache(self):
        self.calls.append("flush")
        return types.SimpleNamespace(success=True)


def run(main, **stand_in):
    """``main(tm, session)``: a session over a fresh stand-in tokenizer manager."""

    async def go():
        tm = StandInTokenizerManager(**stand_in)
        await main(tm, WeightSyncSession(tm, lambda: []))

    asyncio.run(go())


async def reader_can_enter(lock: RWLock, within: float = 0.2) -> bool:
    try:
        await asyncio.wait_for(lock.acquire_reader(), within)
    except asyncio.TimeoutError:
        return False
    await lock.release_reader()
    return True


def test_begin_waits_for_in_flight_requests_and_holds_new_ones():
    async def main(tm, session):
        await tm.model_update_lock.acquire_reader()  # a request in flight
        begin = asyncio.ensure_future(session.begin(lease_s=60))
        await asyncio.sleep(0.05)
        assert not begin.done() and tm.calls == []  # draining
        await tm.model_update_lock.release_reader()
        opened = await asyncio.wait_for(begin, 5)
        # drained, then paused in place (ranks pull only while paused), then begun
        assert tm.calls == ["pause in_place", "begin"] and session.status()["update_open"]
        assert not await reader_can_enter(tm.model_update_lock)  # new requests held
        out = await session.end(weight_version="v2", session_id=opened["session_id"])
        assert out["success"] and out["flushed_cache"]
        assert tm.calls == ["pause in_place", "begin", "version v2", "end", "flush", "continue"]
        assert await reader_can_enter(tm.model_update_lock) and not tm.is_pause  # serving resumed

    run(main)


def test_a_caller_who_paused_first_stays_paused_after_the_session():
    async def main(tm, session):
        opened = await session.begin(lease_s=60)
        await session.end(weight_version="v4", session_id=opened["session_id"])
        assert tm.calls == ["begin", "version v4", "end", "flush"] and tm.is_pause

    run(main, paused=True)


def test_an_abort_drops_the_update_through_sglangs_end_and_continues():
    async def main(tm, session):
        opened = await session.begin(lease_s=60)
        await session.abort("trainer died", session_id=opened["session_id"])
        assert tm.calls == ["pause in_place", "begin", "abort: trainer died", "continue"]
        assert await reader_can_enter(tm.model_update_lock) and not session.status()["update_open"]

    run(main)


def test_a_drain_that_times_out_changes_nothing():
    async def main(tm, session):
        await tm.model_update_lock.acquire_reader()
        with pytest.raises(WeightSyncSessionError, match="did not finish within 0 s; nothing was changed"):
            await session.begin(drain_timeout_s=0.05)
        assert tm.calls == [] and not session.status()["update_open"]
        await tm.model_update_lock.release_reader()
        assert await reader_can_enter(tm.model_update_lock)

    run(main)


def test_one_session_at_a_time_and_ids_are_checked():
    async def main(tm, session):
        opened = await session.begin(lease_s=60)
        with pytest.raises(WeightSyncSessionError, match="already open"):
            await session.begin()
        with pytest.raises(WeightSyncSessionError, match="is not the open one"):
            await session.end(session_id="someone-elses")
        await session.abort("test over", session_id=opened["session_id"])
        with pytest.raises(WeightSyncSessionError, match="no update session is open"):
            await session.end()
        assert await reader_can_enter(tm.model_update_lock)

    run(main)


def test_a_rank_problem_fails_the_end_after_closing_the_session():
    async def main(tm, session):
        await session.begin(lease_s=60)
        with pytest.raises(WeightSyncSessionError, match="transfer broke mid-way"):
            await session.end(weight_version="v3")
        assert not session.status()["update_open"]
        assert await reader_can_enter(tm.model_update_lock)  # not stuck paused

    run(main, end_problem="rank dp0/pp0/tp0: transfer broke mid-way")


def test_a_session_past_its_lease_is_aborted_by_the_engine():
    async def main(tm, session):
        opened = await session.begin(lease_s=0.05)
        for _ in range(200):  # wait on the condition, bounded
            if not session.status()["update_open"]:
                break
            await asyncio.sleep(0.01)
        assert not session.status()["update_open"]
        assert await reader_can_enter(tm.model_update_lock)
        assert tm.calls[2].startswith("abort: the update session was not finalized within its 0 s lease")
        assert tm.calls[3:] == ["continue"] and not tm.is_pause
        with pytest.raises(WeightSyncSessionError, match="no update session is open"):
            await session.end(session_id=opened["session_id"])

    run(main)


# --------------------------------------------------------------------------- #
# /weight_sync/* and the engine-wide view (rdt/engine/http_routes.py)
# --------------------------------------------------------------------------- #
def test_engine_view_is_derived_from_the_ranks():
    from sglang.srt.ray.rdt.engine.http_routes import engine_view

    ok = {"weights_consistent": True, "weight_version": "v2", "updates": 3, "failed_updates": 0}
    torn = {"weights_consistent": False, "inconsistent_reason": "rank 1: transfer broke",
            "weight_version": "v1", "updates": 2, "failed_updates": 1}
    assert engine_view([ok, ok]) == {"weights_consistent": True, "inconsistent_reason": None,
                                     "weight_version": "v2", "updates": 3, "failed_updates": 0}
    view = engine_view([ok, torn])
    assert view["weights_consistent"] is False and view["inconsistent_reason"] == "rank 1: transfer broke"
    assert view["weight_version"] == ["v1", "v2"]  # ranks disagree: both shown
    assert view["updates"] == 2 and view["failed_updates"] == 1


def test_weight_sync_routes_answer_with_the_sessions_decisions():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang.srt.ray.rdt.engine.http_routes import install_weight_sync_routes

    tm = StandInTokenizerManager()
    launched = types.SimpleNamespace(
        tokenizer_manager=tm, scheduler_init_result=types.SimpleNamespace(scheduler_actors=[])
    )
    app = FastAPI()
    install_weight_sync_routes(app, types.SimpleNamespace(), launched)
    with TestClient(app) as http:
        r = http.post("/weight_sync/begin", json={"lease_s": 60})
        assert r.status_code == 200 and r.json()["success"] and r.json()["session_id"]
        r2 = http.post("/weight_sync/begin", json={})
        assert r2.status_code == 409 and "already open" in r2.json()["message"]
        st = http.get("/weight_sync/status").json()
        assert st["update_open"]
        # no rank answered (there are none): the engine does not claim consistency
        assert st["ranks"] is None and st["weights_consistent"] is False
        assert "status could not be read" in st["inconsistent_reason"]
        r3 = http.post("/weight_sync/end", json={"weight_version": 5, "session_id": r.json()["session_id"]})
        assert r3.status_code == 200 and r3.json()["weight_version"] == "5"
        assert tm.calls == ["pause in_place", "begin", "version 5", "end", "flush", "continue"]
        assert http.post("/weight_sync/abort", json={}).status_code == 409  # nothing open
