"""The same-node call lane: the rank's side (engine/local_lane.py) and the
trainer's (trainer/lane.py).

Most tests run a rank core (``standalone_rank``: the SchedulerActor's pull
path around a toy model) in this process, serve its lane and talk to it
through the trainer side's own ``RankLink``/``Lanes``; the trainer's tensors
are read with ``process_vm_readv`` as on any CPU host. A rank that dies and
the lanes a client opens through Ray use real rank actors.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import wait_until

from sglang.srt.ray.rdt import lane_wire
from sglang.srt.ray.rdt.engine.local_lane import DIR_PREFIX, remove_dead_lanes
from sglang.test.rdt_standalone import standalone_rank
from sglang.srt.ray.rdt.errors import WeightSyncError, WeightSyncRankError
from sglang.srt.ray.rdt.lane_wire import FRAME, recv_frame, send_frame
from sglang.srt.ray.rdt.ranks import gather, unfinished
from sglang.srt.ray.rdt.trainer import buckets
from sglang.srt.ray.rdt.trainer.discovery import RankInfo
from sglang.srt.ray.rdt.trainer.lane import Lanes, RankGone, RankLink
from sglang.srt.ray.rdt.transport import same_node

NODE = "lane-test-node"


@pytest.fixture
def rank(monkeypatch):
    """A paused rank core around a two-layer model, in this process. Its lane
    asks which Ray node it is on: that is set here (asking Ray would start
    one in the test process)."""
    monkeypatch.setattr(same_node, "_node_id", NODE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    sync = standalone_rank(model, rank="lane-test", pull_timeout_s=10)
    sync.port.is_paused = True  # pulls are accepted; each update ends with finalize
    sync.model = model
    yield sync
    sync.loop.stop()
    sync.shutdown()


def open_link(rank, sender=None):
    """Open ``rank``'s lane for this process and connect to it (hello included)."""
    sender = sender or same_node.token()
    info = rank.open_lane(sender, os.getpid())
    return info, RankLink(info["address"], info["secret"], info["pid"], sender)


def group_of(named, layout: int) -> buckets.Group:
    (group,) = buckets.cut(named.items(), 1 << 30)
    group.layout = layout
    return group


def new_weights(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


class BusyScheduler:
    """The rank's scheduler thread kept busy by a task that waits until
    :meth:`release` (or the end of the ``with`` block)."""

    def __init__(self, rank):
        self._holding, self._release = threading.Event(), threading.Event()

        def hold():
            self._holding.set()
            self._release.wait(60)

        self._thread = threading.Thread(target=rank.on_scheduler, args=(hold,))

    def __enter__(self):
        self._thread.start()
        assert self._holding.wait(30)
        return self

    def release(self) -> None:
        self._release.set()

    def __exit__(self, *exc):
        self._release.set()
        self._thread.join(30)


# --------------------------------------------------------------------------- #
# Who may call
# --------------------------------------------------------------------------- #
def test_hello_admits_only_the_trainer_process_that_opened_the_lane(rank):
    info, link = open_link(rank, "trainer-a")
    try:
        assert info["node_id"] == NODE and info["pid"] == os.getpid()
        assert rank.lane.status() == {"open": True, "senders": 1, "calls": 1}  # the hello
        assert rank.status().lane == rank.lane.status()
        # A process that did not ask the actor for the lane is refused by name.
        with pytest.raises(WeightSyncError, match=r"refused the call: this trainer process did not "
                           r"open the lane \(open_weight_sync_lane\)"):
            RankLink(info["address"], info["secret"], info["pid"], "trainer-b")
        # With the secret but without a hello, nothing is served.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(info["address"])
            send_frame(sock, info["secret"], b"\x07" * 8, pickle.dumps(("finalize", {})))
            body = recv_frame(sock)
        assert body[:8] == b"\x07" * 8 and pickle.loads(body[8:]) == ("error", "say hello first")
        assert rank.state.status()["updates"] == 0  # the finalize did not run
    finally:
        link.close()


def test_a_wrong_secret_is_denied_without_unpickling_the_request(rank, tmp_path):
    info, link = open_link(rank)
    link.close()
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(info["address"])
        send_frame(sock, b"x" * 16, b"\x01" * 8, pickle.dumps(("hello", Evil())))
        body = recv_frame(sock)
        assert body[:8] == b"\x01" * 8
        assert pickle.loads(body[8:]) == ("error", "wrong lane secret")
        # Not a frame of ours (too short to hold the secret): the lane hangs up.
        send_frame(sock, b"short")
        assert recv_frame(sock) is None
    assert not marker.exists()
    # The trainer side says so at its hello.
    with pytest.raises(WeightSyncError, match="refused the call: wrong lane secret"):
        RankLink(info["address"], b"y" * 16, info["pid"], same_node.token())
    # Only this user may reach the socket at all.
    assert os.stat(os.path.dirname(info["address"])).st_mode & 0o077 == 0
    assert os.path.basename(os.path.dirname(info["address"])).startswith(f"{DIR_PREFIX}{os.getpid()}-")


# --------------------------------------------------------------------------- #
# Layouts and pulls
# --------------------------------------------------------------------------- #
def test_a_layout_is_defined_once_per_connection_and_later_pulls_name_it(rank):
    model = rank.model
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    _, link = open_link(rank)
    lanes = Lanes()
    lanes.links[0] = link
    sent = []  # (op, what each request carried)
    real_send = link.send
    link.send = lambda op, kw: sent.append((op, dict(kw))) or real_send(op, kw)
    try:
        # The first pull of layout 7 carries its names and specs.
        w1 = new_weights(model, 1)
        g1 = group_of(w1, layout=7)
        call = lanes.pull(0, g1, same_node.export(g1.tensors, with_specs=False), 10.0)
        out = call.result(30)
        assert sent[-1][0] == "pull"
        assert sent[-1][1]["names"] == list(w1) and sent[-1][1]["specs"] == g1.specs()
        assert (out["tensors"], out["transport"], out["plan_reused"]) == (4, "cma", False)
        assert all(torch.equal(p, w1[n]) for n, p in model.named_parameters())
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # in place
        # Known on this lane only once the trainer saw the pull succeed.
        assert call.defines == 7 and link.defined == set()
        lanes.defined(0, call)
        assert link.defined == {7}

        # New tensors of the same layout: the request names the layout only.
        w2 = new_weights(model, 2)
        g2 = group_of(w2, layout=7)
        call = lanes.pull(0, g2, same_node.export(g2.tensors, with_specs=False), 10.0)
        out = call.result(30)
        assert sent[-1][1]["names"] is None and sent[-1][1]["specs"] is None
        assert call.defines is None and out["plan_reused"] is True
        assert all(torch.equal(p, w2[n]) for n, p in model.named_parameters())

        # A layout never defined on this connection is refused before any byte moves.
        w3 = new_weights(model, 3)
        g3 = group_of(w3, layout=8)
        with pytest.raises(KeyError, match="layout 8 was never defined on this connection"):
            link.send("pull", {"layout": 8, "names": None, "specs": None, "timeout": 10.0,
                               "source": same_node.export(g3.tensors, with_specs=False)}).result(30)
        # So is a definition whose names do not fit its tensors.
        with pytest.raises(WeightSyncError, match="layout 9: 1 names for 4 tensors"):
            link.send("pull", {"layout": 9, "names": ["0.weight"], "specs": g3.specs(), "timeout": 10.0,
                               "source": same_node.export(g3.tensors, with_specs=False)}).result(30)
        assert all(torch.equal(p, w2[n]) for n, p in model.named_parameters())

        # Definitions belong to a connection: another one must define layout 7 again.
        _, other = open_link(rank)
        try:
            with pytest.raises(KeyError, match="layout 7 was never defined on this connection"):
                other.send("pull", {"layout": 7, "names": None, "specs": None, "timeout": 10.0,
                                    "source": same_node.export(g3.tensors, with_specs=False)}).result(30)
            fresh = Lanes()
            fresh.links[0] = other
            g3.layout = 7
            assert fresh.pull(0, g3, same_node.export(g3.tensors, with_specs=False), 10.0).result(30)["tensors"] == 4
            assert all(torch.equal(p, w3[n]) for n, p in model.named_parameters())
        finally:
            other.close()

        # The update ends over the lane too; its writer is this trainer process.
        done = link.send("finalize", {"weight_version": "v3"}).result(30)
        assert done["weight_version"] == "v3" and done["update"]["consistent"] is True
        assert done["update"]["pulls"] == 3
        assert done["update"]["writer_labels"] == [f"trainer process {os.getpid()} (same-node lane)"]
    finally:
        lanes.close()


def test_a_remembered_description_is_sent_once_per_connection_and_then_named(rank):
    """A description the exporter remembers (kept memory: the staging pool)
    goes over the lane once with its id; later pulls name the id and the rank
    reads the one it keeps. A pull may also end the update it lands in."""
    model = rank.model
    _, link = open_link(rank)
    lanes = Lanes()
    lanes.links[0] = link
    sent = []
    real_send = link.send
    link.send = lambda op, kw: sent.append(dict(kw)) or real_send(op, kw)
    try:
        w = new_weights(model, 1)
        group = group_of(w, layout=7)
        meta = same_node.export(group.tensors, with_specs=False)
        meta.ipc = SimpleNamespace(kept_id=5)  # (as the GPU exporter marks kept memory; read by CMA here)
        call = lanes.pull(0, group, meta, 10.0)
        call.result(30)
        assert sent[-1]["source"] is meta and sent[-1]["source_id"] == 5
        assert call.defines_source == 5 and link.sources == set()  # known once the pull succeeded
        lanes.defined(0, call)
        assert link.sources == {5}
        # The same places refilled: the request names the description only.
        for t in w.values():
            t.add_(1.0)
        call = lanes.pull(0, group, meta, 10.0)
        call.result(30)
        assert sent[-1]["source"] is None and sent[-1]["source_id"] == 5 and call.defines_source == 0
        assert all(torch.equal(p, w[n]) for n, p in model.named_parameters())
        done = link.send("finalize", {"weight_version": "kept-2"}).result(30)
        assert (done["weight_version"], done["update"]["pulls"], done["update"]["consistent"]) == ("kept-2", 2, True)
        # A description never sent on this connection is refused before any byte moves.
        with pytest.raises(KeyError, match="source 6 was never sent on this connection"):
            link.send("pull", {"layout": 7, "names": None, "specs": None, "timeout": 10.0,
                               "source": None, "source_id": 6}).result(30)
        assert rank.state.status()["update_open"] is False
    finally:
        lanes.close()


def test_the_next_pull_is_read_and_queued_while_one_waits_and_a_finalize_waits_for_both(rank):
    """Two pulls sent back to back on one connection: the lane reads the
    second and queues it at the scheduler's safe point while the first still
    waits there (the rank then copies them back to back); a finalize sent
    after them is read but answered only after both, and ends an update of both."""
    model = rank.model
    items = list(new_weights(model, 21).items())
    halves = [dict(items[:2]), dict(items[2:])]
    _, link = open_link(rank)
    lanes = Lanes()
    lanes.links[0] = link
    try:
        with BusyScheduler(rank) as busy:
            calls = []
            for layout, half in enumerate(halves, 1):
                g = group_of(half, layout=layout)
                calls.append(lanes.pull(0, g, same_node.export(g.tensors, with_specs=False), 10.0))
            done = link.send("finalize", {"weight_version": "both"})
            # hello, both pulls and the finalize read; nothing has run yet
            wait_until(lambda: rank.lane.status()["calls"] == 4, 30, 0.01, "the lane to read every request")
            assert rank.state.status()["pulls"] == 0 and not rank.state.status()["update_open"]
            busy.release()
            assert [c.result(30)["tensors"] for c in calls] == [2, 2]
            out = done.result(30)
            assert (out["weight_version"], out["update"]["pulls"], out["update"]["consistent"]) == ("both", 2, True)
            assert all(torch.equal(p, dict(items)[n]) for n, p in model.named_parameters())
    finally:
        lanes.close()


def test_a_trainer_that_leaves_mid_update_leaves_the_rank_inconsistent_until_a_whole_update(rank):
    """A trainer process whose lane closes after it wrote part of an update
    (killed, or gone before it ended the update): under a plain pause nobody
    else would end that update, so the rank aborts it and reports its weights
    inconsistent until a complete update ends."""
    model = rank.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w1 = new_weights(model, 11)
    _, link = open_link(rank)
    lanes = Lanes()
    lanes.links[0] = link
    half = dict(list(w1.items())[:2])
    g = group_of(half, layout=1)
    assert lanes.pull(0, g, same_node.export(g.tensors, with_specs=False), 10.0).result(30)["tensors"] == 2
    assert rank.state.status()["update_open"] is True
    lanes.close()  # gone without ending the update
    wait_until(lambda: not rank.state.status()["update_open"], 30, what="the rank to abort the update")
    st = rank.state.status()
    assert st["weights_consistent"] is False and st["failed_updates"] == 1
    assert st["inconsistent_reason"] == (f"trainer process {os.getpid()} (same-node lane) closed its lane "
                                         "before the update it wrote in ended")
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], half[n]) for n in half)  # what landed stays, reported
    assert all(torch.equal(params[n], before[n]) for n in list(w1)[2:])
    # A complete update makes the rank whole again.
    w2 = new_weights(model, 12)
    _, link = open_link(rank)
    lanes = Lanes()
    lanes.links[0] = link
    try:
        g = group_of(w2, layout=2)
        lanes.pull(0, g, same_node.export(g.tensors, with_specs=False), 10.0).result(30)
        done = link.send("finalize", {"weight_version": "whole"}).result(30)
        assert done["update"]["consistent"] is True
    finally:
        lanes.close()
    st = rank.state.status()
    assert (st["weights_consistent"], st["update_open"], st["weight_version"]) == (True, False, "whole")
    # Closing a lane with no update open changes nothing.
    assert rank.state.status()["failed_updates"] == 1


def test_a_rank_that_cannot_read_the_trainers_memory_gets_no_lane(rank, monkeypatch):
    """The lane opens only after the rank read a probe of the trainer's
    memory: the bytes it described, exactly."""
    probe = torch.arange(256, dtype=torch.uint8)
    info = rank.open_lane("trainer-p", os.getpid(), same_node.export([probe]))
    assert "address" in info and "unreadable" not in info
    wrong = torch.zeros(256, dtype=torch.uint8)
    assert rank.open_lane("trainer-q", os.getpid(), same_node.export([wrong])) == {
        "node_id": NODE, "unreadable": "a probe read returned other bytes than the trainer's"}
    monkeypatch.setenv("SGLANG_RDT_CMA", "0")  # e.g. a container without ptrace rights
    assert rank.open_lane("trainer-r", os.getpid(), same_node.export([probe])) == {
        "node_id": NODE, "unreadable": "SGLANG_RDT_CMA=0"}
    assert rank.lane.status()["senders"] == 1  # only trainer-p was let in


def test_the_ranks_own_failure_comes_back_as_itself(rank):
    """A pull the rank refuses raises the rank's exception on the trainer side."""
    _, link = open_link(rank)
    try:
        rank.port.is_paused = False  # generation runs: no pull may land
        w = new_weights(rank.model, 4)
        g = group_of(w, layout=1)
        lanes = Lanes()
        lanes.links[0] = link
        call = lanes.pull(0, g, same_node.export(g.tensors, with_specs=False), 10.0)
        with pytest.raises(WeightSyncError, match="refusing to pull weights while generation may run"):
            call.result(60)
        assert not any(torch.equal(p, w[n]) for n, p in rank.model.named_parameters())
        assert rank.state.status()["failures"] == {"rejected": 1}
        assert not link.broken  # a refusal is an answer: the lane stays up
    finally:
        link.close()


# --------------------------------------------------------------------------- #
# Writes the trainer makes itself
# --------------------------------------------------------------------------- #
def grant(link, group, layout: int = 5):
    """Ask the rank for ``group``'s targets (the layout defined with it)."""
    return link.send("grant", {"layout": layout, "names": group.names, "specs": group.specs(),
                               "timeout": 10.0}).result(30)


def pushed(link, out, outcome: str, group):
    return link.send("pushed", {"grant": out["grant"], "outcome": outcome, "transport": "direct write",
                                "tensors": len(group.names), "bytes": group.nbytes, "seconds": 0.01}).result(30)


def write_granted(targets, tensors) -> None:
    """The trainer's write, here where the rank lives: each tensor's bytes at
    the address the grant names (a trainer on a GPU runs its copy kernel)."""
    part = targets.cma
    for t, address, n in zip(tensors, part.address.tolist(), part.nbytes.tolist()):
        assert t.nbytes == n
        src = t.contiguous()
        ctypes.memmove(address, src.data_ptr(), n)


def test_a_granted_write_lands_in_place_and_counts_once_confirmed(rank):
    """The rank grants its parameters after the checks of a pull (described
    by address for a writer on its own device); the writer writes them, and
    the update counts them once the write is confirmed: every byte in place,
    the update consistent."""
    model = rank.model
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    _, link = open_link(rank)
    try:
        w = new_weights(model, 31)
        views = {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in w.items()}  # not contiguous
        group = group_of(views, layout=5)
        out = grant(link, group)
        assert (out["tensors"], out["bytes"]) == (4, group.nbytes) and out["targets"].cma is not None
        assert rank.state.status()["update_in_progress"]["params_written"] == 0  # granted, not written
        write_granted(out["targets"], list(views.values()))
        assert all(torch.equal(p, w[n]) for n, p in model.named_parameters())
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        assert pushed(link, out, "done", group)["outcome"] == "done"
        done = link.send("finalize", {"weight_version": "w1"}).result(30)
        assert (done["update"]["params_updated"], done["update"]["consistent"]) == (4, True)
        assert done["update"]["transport"] == "direct write"
    finally:
        link.close()


@pytest.mark.parametrize("ending", ["finalize", "abort", "lane closed", "broken"])
def test_a_grant_never_confirmed_done_leaves_the_weights_inconsistent(rank, ending):
    """A grant whose write is not confirmed done: finalize refuses to call
    the update consistent, an abort or the trainer's lane closing marks the
    weights inconsistent, a write reported broken too; a write confirmed
    after its update was aborted is refused and marks them inconsistent."""
    model = rank.model
    _, link = open_link(rank)
    group = group_of(new_weights(model, 32), layout=5)
    try:
        out = grant(link, group)
        if ending == "finalize":
            with pytest.raises(WeightSyncError, match="4 parameters granted for a direct write were never "
                                                      "confirmed written"):
                link.send("finalize", {"weight_version": "w2"}).result(30)
        elif ending == "abort":
            link.send("abort", {"reason": "stop"}).result(30)
            with pytest.raises(WeightSyncError, match="reported a direct write done that no open update granted"):
                pushed(link, out, "done", group)
        elif ending == "broken":
            pushed(link, out, "broken", group)
            with pytest.raises(WeightSyncError, match="4 parameters of a transfer that broke"):
                link.send("finalize", {"weight_version": "w2"}).result(30)
        else:
            link.close()
            wait_until(lambda: not rank.state.consistent and not rank.state.update_open, 30,
                       what="the rank to abort the update of a writer gone")
        st = rank.state.status()
        assert (st["weights_consistent"], st["update_open"]) == (False, False)
    finally:
        link.close()


def test_a_grant_released_unwritten_leaves_the_update_clean_and_a_refused_one_grants_nothing(rank):
    """A grant the trainer gives back unwritten ("none") leaves nothing to
    repair; a grant refused like a pull (a name the rank lacks) grants
    nothing; a grant of another writer's ids is no confirmation."""
    model = rank.model
    _, link = open_link(rank)
    _, other = open_link(rank, "other-trainer")
    try:
        group = group_of(new_weights(model, 33), layout=5)
        out = grant(link, group)
        with pytest.raises(WeightSyncError, match="no open update granted"):
            pushed(other, {"grant": out["grant"]}, "done", group)  # not its grant
        assert pushed(link, out, "none", group)["outcome"] == "none"
        bad = group_of({"no.such": torch.zeros(2)}, layout=6)
        with pytest.raises(WeightSyncError, match="no.such"):
            grant(link, bad, layout=6)
        assert rank.state.status()["update_in_progress"]["params_written"] == 0
        other.close()  # (its refused confirmation marked the weights; a clean update repairs them)
        out = grant(link, group)
        pushed(link, out, "done", group)
        done = link.send("finalize", {"weight_version": "w3"}).result(30)
        assert done["update"]["consistent"] is True and rank.state.consistent
    finally:
        link.close()
        other.close()
# --------------------------------------------------------------------------- #
# Nothing hangs
# --------------------------------------------------------------------------- #
def test_a_trainer_stalling_in_a_frame_is_cut_off_and_others_are_served(rank, monkeypatch):
    monkeypatch.setattr(lane_wire, "FRAME_TIMEOUT_S", 0.3)
    info, first = open_link(rank)
    first.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.settimeout(10)
        stalled.connect(info["address"])
        stalled.sendall(FRAME.pack(1000) + b"x" * 10)  # ... and nothing more
        # The lane hangs up on it (recv_frame raises socket.timeout after 10 s otherwise).
        assert recv_frame(stalled, timeout_s=10) is None
    _, link = open_link(rank)
    try:
        assert link.send("abort", {"reason": "test"}).result(10)["weights_consistent"] is True
    finally:
        link.close()


class ScriptedRank:
    """A Unix socket that answers the hello as a rank's lane does, then hands
    the next request's id to ``then(conn, req_id)``; it holds the connection
    open until closed."""

    def __init__(self, path: str, then):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.listener.settimeout(30)
        self.then = then
        self.conn = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        self.conn = conn
        body = recv_frame(conn, timeout_s=30)
        send_frame(conn, body[16:24], pickle.dumps(("ok", {"pid": os.getpid()})))
        body = recv_frame(conn, timeout_s=30)
        self.then(conn, body[16:24])

    def close(self):
        self.thread.join(timeout=30)
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def test_a_rank_stalling_in_its_answer_breaks_the_lane_instead_of_holding_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(lane_wire, "FRAME_TIMEOUT_S", 0.3)
    path = str(tmp_path / "lane")
    server = ScriptedRank(path, lambda conn, req_id: conn.sendall(FRAME.pack(100) + req_id + b"x"))
    link = RankLink(path, b"s" * 16, os.getpid(), "trainer")
    try:
        call = link.send("pull", {})
        # (socket.timeout is TimeoutError; its text is the socket's or recv_frame's own)
        with pytest.raises(RankGone, match=r"the rank \(pid \d+\) stalled in the middle of an answer"):
            call.result(120)
        assert link.broken
        with pytest.raises(RankGone, match=r"the call lane to the rank \(pid \d+\) broke earlier"):
            link.send("abort", {})
    finally:
        link.close()
        server.close()


def test_a_call_waits_no_longer_than_its_timeout_and_names_a_rank_process_that_exited(tmp_path):
    path = str(tmp_path / "lane")
    server = ScriptedRank(path, lambda conn, req_id: None)  # never answers
    rank_process = subprocess.Popen(["sleep", "120"])
    try:
        link = RankLink(path, b"s" * 16, rank_process.pid, "trainer")
        call = link.send("pull", {})
        # Alive but silent: bounded by the caller's timeout, the lane stays usable.
        with pytest.raises(TimeoutError, match=rf"no answer on the call lane within the timeout \(is the "
                           rf"scheduler of pid {rank_process.pid} stuck\?\)"):
            call.result(0.5)
        assert not link.broken
        # A bounded wait that runs out leaves it unfinished: a slot it reads stays reserved.
        call.wait(0.2)
        assert not call.finished() and unfinished([(0, call)]) == [call]
        # Its process exits while the socket stays open (here, held by another
        # process): the liveness check names it instead of waiting out 120 s.
        rank_process.kill()
        rank_process.wait()
        with pytest.raises(RankGone, match=rf"the rank's process \(pid {rank_process.pid}\) exited during the call$"):
            call.result(120)
        assert link.broken
        link.close()
    finally:
        if rank_process.poll() is None:
            rank_process.kill()
            rank_process.wait()
        server.close()


# --------------------------------------------------------------------------- #
# Closing and dead ranks
# --------------------------------------------------------------------------- #
def test_close_stops_serving_and_removes_the_socket_directory(rank):
    info, link = open_link(rank)
    directory = os.path.dirname(info["address"])
    assert os.path.isdir(directory)
    rank.shutdown()  # the rank core closes its lane
    assert not os.path.exists(directory)
    assert rank.lane.status()["open"] is False
    with pytest.raises(RuntimeError, match="the rank's lane is closed"):
        rank.open_lane("trainer-b", 1)
    # The trainer's connection ends with the lane: its next call says so.
    with pytest.raises(RankGone, match=rf"the call lane to the rank \(pid {os.getpid()}\) broke|closed its lane"):
        link.send("abort", {}).result(30)
    link.close()


def test_the_lane_directory_of_a_dead_rank_is_removed_by_the_next_lane(tmp_path):
    """A killed rank cannot remove its socket directory; the next lane that
    starts on the host removes those of processes that are gone."""
    alive_proc = subprocess.Popen(["sleep", "60"])
    alive = tmp_path / f"{DIR_PREFIX}{alive_proc.pid}-abc"
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
        alive_proc.kill()
        alive_proc.wait()


def test_a_rank_killed_during_a_lane_pull_is_named_at_once(ray_client):
    """A real rank actor is killed while its lane pull waits on its scheduler
    thread: the trainer's wait ends with RankGone, named by rank, not a timeout;
    the lane is dropped; the dead rank's socket directory goes away."""
    from client_actors import FakeRank
    from rdt_actors import process_gone

    victim = FakeRank.remote(0)
    info = ray_client.get(victim.open_weight_sync_lane.remote(same_node.token(), os.getpid()), timeout=120)
    assert info["node_id"] == same_node.node_id()
    lanes = Lanes()
    lanes.links[0] = RankLink(info["address"], info["secret"], info["pid"], same_node.token())
    layout = ray_client.get(victim.get_parameter_layout.remote(), timeout=60)
    named = {n: torch.ones(spec["shape"]) for n, spec in layout.items()}
    group = group_of(named, layout=1)
    ray_client.get(victim.configure.remote(delay_s=600), timeout=60)  # the pull waits before reading
    call = lanes.pull(0, group, same_node.export(group.tensors, with_specs=False), 600)
    wait_until(lambda: ray_client.get(victim.log.remote(), timeout=60)["starts"], 60,
               interval=0.05, what="the lane pull to reach the rank's scheduler thread")
    ray_client.kill(victim)
    with pytest.raises(WeightSyncRankError) as e:
        gather([(0, call)], "pull of step 1", 600)
    assert isinstance(e.value.cause, RankGone)
    assert str(e.value).startswith(f"rank 0 failed during pull of step 1: RankGone: the rank's process "
                                   f"(pid {info['pid']}) exited during the call")
    assert lanes.link(0) is None  # later calls go through Ray
    lanes.close()
    # The killed process could not remove its socket directory; the next lane
    # that starts on the host removes it once the process is gone (a zombie
    # still counts as there until its parent reaps it).
    directory = os.path.dirname(info["address"])
    wait_until(lambda: process_gone(info["pid"]), 60, what="the killed rank's process to exit")
    wait_until(lambda: remove_dead_lanes(os.path.dirname(directory)) >= 0 and not os.path.exists(directory),
               60, what="the dead rank's lane directory to be removed")


def test_a_client_opens_lanes_to_the_ranks_on_its_node_only(ray_client, caplog):
    """Lanes.open asks each rank on this node for its lane; a rank elsewhere,
    or one whose lane cannot open, is left to Ray calls (with a warning)."""
    from client_actors import FakeRank

    actors = [FakeRank.remote(i) for i in range(3)]
    try:
        # Rank 2 served a lane once and has been shut down since: its lane stays closed.
        ray_client.get(actors[2].open_weight_sync_lane.remote("an-earlier-trainer", 1), timeout=120)
        ray_client.get(actors[2].shutdown_weight_sync.remote(), timeout=60)
        here = same_node.node_id()
        statuses = [{"ipc_reach": {"node_id": here}}, {"ipc_reach": {"node_id": "another-node"}},
                    {"ipc_reach": {"node_id": here}}]
        ranks = [RankInfo(i, a, f"fake-{i}") for i, a in enumerate(actors)]
        lanes = Lanes()
        with caplog.at_level("WARNING", logger="sglang.srt.ray.rdt.trainer.lane"):
            lanes.open(ranks, statuses, 120)
        try:
            assert set(lanes.links) == {0}
            st = ray_client.get(actors[0].get_weight_sync_status.remote(), timeout=60)["lane"]
            assert st == {"open": True, "senders": 1, "calls": 1}
            assert ray_client.get(actors[1].get_weight_sync_status.remote(), timeout=60)["lane"] == {"open": False}
            assert any("no call lane to rank 2 (fake-2)" in r.getMessage() for r in caplog.records)
            lanes.open(ranks, statuses, 120)  # once only
            assert ray_client.get(actors[0].get_weight_sync_status.remote(), timeout=60)["lane"]["calls"] == 1
        finally:
            lanes.close()
        assert lanes.links == {} and lanes.link(0) is None
    finally:
        for a in actors:
            ray_client.kill(a)
