"""The same-node call lane (engine/local_lane.py, trainer/lane.py), without Ray.

A rank's lane runs whatever pull it was given for a request that carries its
secret and names refs it holds; these tests give it a recording pull and
talk to it through the trainer side's own RankLink.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time

import socket

import pytest

from sglang.srt.ray.rdt.defaults import LANE_NOT_HELD as NOT_HELD
from sglang.srt.ray.rdt.engine.local_lane import RankLane
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightsInconsistentError
from sglang.srt.ray.rdt.lane_wire import recv_frame, send_frame
from sglang.srt.ray.rdt.trainer.lane import LaneCall, RankGone, RankLink


class FakeRef:
    def __init__(self, hex_id: str):
        self._hex = hex_id

    def hex(self) -> str:
        return self._hex


@pytest.fixture
def lane():
    calls = []

    def pull(refs, names, timeout, finalize):
        calls.append((refs, names, timeout, finalize))
        if names == ["boom"]:
            raise WeightsInconsistentError("the transfer broke half-way")
        return {"tensors": len(names), "refs": [r.hex() for r in refs]}

    lane = RankLane(pull)
    info = lane.open("trainer-a")
    lane.calls_seen = calls
    lane.info = info
    yield lane
    lane.close()


def test_a_lane_call_runs_the_ranks_pull_on_a_held_ref_and_returns_its_result(lane):
    ref = FakeRef("ab" * 20)
    lane._held["trainer-a"] = {ref.hex(): ref}  # what keep() records after a read through Ray
    link = RankLink(lane.info["address"], lane.info["secret"], lane.info["pid"])
    try:
        out = link.send("pull_weights", {"ref_ids": [ref.hex()], "names": ["w", "b"], "timeout": 5.0,
                                         "finalize": {"weight_version": "7"}}).result(10)
        assert out == {"tensors": 2, "refs": [ref.hex()]}
        (refs, names, timeout, finalize), = lane.calls_seen
        assert refs == [ref] and names == ["w", "b"] and timeout == 5.0
        assert finalize == {"weight_version": "7"}
        # The rank's own exception comes back as itself.
        with pytest.raises(WeightsInconsistentError, match="the transfer broke half-way"):
            link.send("pull_weights", {"ref_ids": [ref.hex()], "names": ["boom"]}).result(10)
        assert lane.status() == {"open": True, "senders": 1, "held_refs": 1, "calls": 2}
        assert lane.release("trainer-a") == 1 and lane.status()["held_refs"] == 0
    finally:
        link.close()


def test_a_ref_the_rank_does_not_hold_is_refused_before_anything_runs(lane):
    link = RankLink(lane.info["address"], lane.info["secret"], lane.info["pid"])
    try:
        call = link.send("pull_weights", {"ref_ids": ["cd" * 20], "names": ["w"]})
        with pytest.raises(WeightSyncError, match=rf"refused the call \({NOT_HELD}\): ref cdcdcdcdcdcdcdcd "
                           "is not held by this rank"):
            call.result(10)
        # With a fall-back, the same refusal sends the call through it instead.
        fell_back = []
        call = link.send("pull_weights", {"ref_ids": ["cd" * 20], "names": ["w"]},
                         fallback=lambda: fell_back.append(1) or _Ready({"through": "ray"}))
        assert isinstance(call, LaneCall)
        assert _result_via(call, 10) == {"through": "ray"} and fell_back == [1]
    finally:
        link.close()
    assert lane.calls_seen == []


def test_a_wrong_secret_is_denied_without_unpickling_the_request(lane, tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(lane.info["address"])
    try:
        send_frame(sock, b"x" * 16, b"\x01" * 8, pickle.dumps(("pull_weights", Evil())))
        body = recv_frame(sock)
        assert body[:8] == b"\x01" * 8
        assert pickle.loads(body[8:]) == ("error", "denied", "wrong lane secret")
        # Not a frame of ours (too short to hold the secret): the lane hangs up.
        send_frame(sock, b"short")
        assert recv_frame(sock) is None
    finally:
        sock.close()
    assert not marker.exists() and lane.calls_seen == []
    assert os.stat(os.path.dirname(lane.info["address"])).st_mode & 0o077 == 0


def test_a_rank_whose_process_is_gone_fails_the_call_at_once(tmp_path):
    # A socket that never answers, and a "rank" pid that has exited.
    address = str(tmp_path / "silent")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(address)
    silent.listen(4)
    proc = subprocess.Popen(["sleep", "60"])
    link = RankLink(address, b"s" * 16, proc.pid)
    try:
        call = link.send("pull_weights", {"ref_ids": [], "names": []})
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(RankGone, match=rf"the rank's process \(pid {proc.pid}\) exited during the call"):
            call.result(120)
        assert time.monotonic() - t0 < 5
        # A live but silent rank: bounded by the caller's timeout.
        alive = subprocess.Popen(["sleep", "60"])
        try:
            slow = RankLink(address, b"s" * 16, alive.pid)
            with pytest.raises(TimeoutError, match="no answer on the call lane within the timeout"):
                slow.send("ping", {}).result(0.5)
            # A rank whose lane connection closes (its process exited) is named
            # as soon as the connection ends.
            conn, _ = silent.accept()
            conn, _ = silent.accept()  # the second link's
            call = slow.send("ping", {})
            conn.close()
            t0 = time.monotonic()
            with pytest.raises(RankGone, match=r"exited during the call, or closed its lane \(the "
                               "connection ended"):
                call.result(120)
            assert time.monotonic() - t0 < 5
            slow.close()
        finally:
            alive.kill()
            alive.wait()
    finally:
        link.close()
        silent.close()


def test_a_client_stalling_in_a_frame_is_cut_off_and_others_are_served(lane, monkeypatch):
    from sglang.srt.ray.rdt import lane_wire

    monkeypatch.setattr(lane_wire, "FRAME_TIMEOUT_S", 0.3)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.settimeout(10)
    stalled.connect(lane.info["address"])
    try:
        stalled.sendall(lane_wire.FRAME.pack(1000) + b"x" * 10)  # ... and nothing more
        t0 = time.monotonic()
        assert recv_frame(stalled, timeout_s=10) is None  # the lane hung up on it
        assert time.monotonic() - t0 < 5
        link = RankLink(lane.info["address"], lane.info["secret"], lane.info["pid"])
        try:
            assert link.send("ping", {}).result(10) == {"pid": os.getpid()}
        finally:
            link.close()
    finally:
        stalled.close()


def test_a_broken_lane_is_dropped_and_pulls_go_through_ray(lane):
    from types import SimpleNamespace

    from sglang.srt.ray.rdt.trainer.lane import Lanes

    ref = FakeRef("ab" * 20)
    through_ray = []
    actor = SimpleNamespace(pull_weights=SimpleNamespace(
        remote=lambda refs, names, timeout, **kw: through_ray.append(names) or "ray-call"))
    rank = SimpleNamespace(index=0, actor=actor, label=lambda: "rank 0")
    lanes = Lanes()
    lanes.links[0] = RankLink(lane.info["address"], lane.info["secret"], lane.info["pid"])
    lanes.held(0, ref)
    lane._held["trainer-a"] = {ref.hex(): ref}
    call = lanes.pull(rank, ref, ["w"], None, {})
    assert isinstance(call, LaneCall) and call.result(10)["tensors"] == 1
    lane.close()  # the rank's lane goes away (its process lives on)
    call = lanes.pull(rank, ref, ["w"], None, {})
    if isinstance(call, LaneCall):  # the request left before the close was seen
        with pytest.raises(RankGone, match="closed its lane"):
            call.result(10)
        call = lanes.pull(rank, ref, ["w"], None, {})
    assert call == "ray-call" and through_ray == [["w"]]
    assert 0 not in lanes.links  # later pulls do not try the lane again
    assert lanes.pull(rank, ref, ["w"], None, {}) == "ray-call"


def test_a_dropped_lane_still_answers_the_calls_already_sent(lane):
    """Two bucket pulls in flight, the second's send fails: the lane is
    dropped for new calls, but the first still gets its answer (else its
    slot would never be released)."""
    from sglang.srt.ray.rdt.trainer.lane import Lanes

    lanes = Lanes()
    lanes.links[0] = RankLink(lane.info["address"], lane.info["secret"], lane.info["pid"])
    call = lanes.links[0].send("ping", {})
    lanes._drop(0)
    assert 0 not in lanes.links
    assert call.result(10) == {"pid": os.getpid()}
    lanes.close()


def test_a_dead_ranks_lane_directory_is_removed_by_the_next_lane(tmp_path):
    """A killed rank cannot remove its socket directory; the next lane that
    starts on the host removes those of processes that are gone."""
    from sglang.srt.ray.rdt.engine.local_lane import DIR_PREFIX, remove_dead_lanes

    proc = subprocess.Popen(["sleep", "60"])
    alive = tmp_path / f"{DIR_PREFIX}{proc.pid}-abc"
    alive.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"{DIR_PREFIX}{gone.pid}-def"
    dead.mkdir()
    (dead / "lane").write_text("")
    other = tmp_path / f"{DIR_PREFIX}notapid-ghi"
    other.mkdir()
    try:
        assert remove_dead_lanes(str(tmp_path)) == 1
        assert not dead.exists() and alive.exists() and other.exists()
    finally:
        proc.kill()
        proc.wait()


def test_close_stops_serving_and_removes_the_socket(lane):
    path = lane.info["address"]
    assert os.path.exists(path)
    lane.close()
    assert not os.path.exists(os.path.dirname(path))
    with pytest.raises(RuntimeError, match="the rank's lane is closed"):
        lane.open("trainer-b")


# -- helpers ------------------------------------------------------------------ #
class _Ready:
    """Stands in for the fall-back's ObjectRef."""

    def __init__(self, value):
        self.value = value


def _result_via(call, timeout_s):
    import ray

    real_get = ray.get
    ray.get = lambda ref, timeout=None: ref.value if isinstance(ref, _Ready) else real_get(ref, timeout=timeout)
    try:
        return call.result(timeout_s)
    finally:
        ray.get = real_get
