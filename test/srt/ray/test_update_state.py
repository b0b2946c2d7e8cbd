"""The rank's update state machine (pure: no Ray, no model)."""

from __future__ import annotations

import logging

import pytest

from sglang.srt.ray.rdt.errors import WeightUpdateConflictError
from sglang.srt.ray.rdt.engine.update_state import RankUpdateState, Writer, format_update

A = Writer("actor:aaa", "actor TrainerA(aaa)")
B = Writer("actor:bbb", "actor TrainerB(bbb)")
NAMES = ["w1", "w2", "w3", "w4"]


def _stats(n, nbytes=100, transports=("nixl",)):
    return {"tensors": n, "bytes": nbytes, "seconds": 0.5, "fetch_seconds": 0.25,
            "transports": list(transports)}


def _state(clock=None):
    version = {"v": None}
    st = RankUpdateState(
        param_names=lambda: list(NAMES), rank="dp0/pp0/tp1",
        weight_version=lambda: version["v"], clock=clock or (lambda: 0.0),
    )
    return st, version


def _pull(st, names, writer):
    st.admit([(names, writer)])
    st.landed([(names, writer)], _stats(len(names)))


def test_one_writer_update_is_summed_and_logged(caplog):
    now = [100.0]
    st, version = _state(lambda: now[0])
    st.begin()
    _pull(st, ["w1", "w2"], A)
    _pull(st, ["w3"], A)
    now[0] = 102.0
    version["v"] = "v7"
    with caplog.at_level(logging.INFO, logger="sglang.srt.ray.rdt.engine.update_state"):
        s = st.end()
    assert (s["pulls"], s["tensors"], s["bytes"], s["weight_version"]) == (2, 3, 200, "v7")
    assert (s["params_updated"], s["params_total"], s["writers"], s["rewrites"]) == (3, 4, 1, 0)
    assert s["never_written"] == ["w4"] and s["never_written_count"] == 1
    assert s["consistent"] is True and s["conflict"] is None and s["update_seconds"] == 2.0
    assert s["transfer_seconds"] == pytest.approx(0.5) and s["transport"] == "nixl"
    line = caplog.records[-1].getMessage()
    assert line.startswith("[RDT] weight update dp0/pp0/tp1 done: weight_version=v7 tensors=3 bytes=200")
    assert "3 of 4 parameters updated by 1 writer (0 rewritten)" in line
    status = st.status()
    assert (status["updates"], status["failed_updates"], status["update_open"]) == (1, 0, False)
    assert status["last_update"] is s and status["pulls"] == 2 and status["bytes"] == 200


def test_two_writers_of_disjoint_parameters_are_one_clean_update():
    st, _ = _state()
    st.begin()
    _pull(st, ["w1", "w2"], A)
    _pull(st, ["w3", "w4"], B)
    s = st.end()
    assert s["consistent"] is True and s["writers"] == 2 and s["params_updated"] == 4
    assert s["writer_labels"] == sorted([A.label, B.label]) and "never_written" in s
    assert s["never_written"] == []


def test_same_writer_rewriting_a_parameter_is_allowed_and_counted():
    st, _ = _state()
    st.begin()
    _pull(st, ["w1", "w2"], A)
    _pull(st, ["w1"], A)
    s = st.end()
    assert s["consistent"] is True and s["rewrites"] == 1 and s["pulls"] == 2


def test_second_writer_of_a_parameter_is_refused_naming_both_and_the_update_is_inconsistent():
    st, _ = _state()
    st.begin()
    _pull(st, ["w1", "w2"], A)          # A's first half
    with pytest.raises(WeightUpdateConflictError) as e:
        st.admit([(["w1", "w2"], B)])     # B's first half: refused before any byte
    msg = str(e.value)
    assert "'w1'" in msg and A.label in msg and B.label in msg
    assert st.consistent is False and st.in_progress()["conflict"] == msg
    _pull(st, ["w3", "w4"], B)          # B's second half: nobody wrote it yet
    with pytest.raises(WeightUpdateConflictError):
        st.admit([(["w3"], A)])           # A's second half
    s = st.end()
    assert s["consistent"] is False and s["conflict"] == msg
    assert st.status()["inconsistent_reason"] == msg
    assert st.failures["conflict"] == 2 and st.failed_updates == 1
    # The next clean update lands and is consistent again.
    st.begin()
    _pull(st, NAMES, B)
    assert st.end()["consistent"] is True and st.consistent is True


def test_a_conflict_in_one_ref_refuses_the_whole_pull():
    st, _ = _state()
    _pull(st, ["w1"], A)
    with pytest.raises(WeightUpdateConflictError):
        st.admit([(["w3"], B), (["w1"], B)])
    assert st.in_progress()["params_written"] == 1  # nothing of B's pull recorded


def test_broken_transfer_stays_inconsistent_until_its_parameters_land_again():
    st, _ = _state()
    st.begin()
    _pull(st, ["w1"], A)
    st.admit([(["w2", "w3"], A)])
    st.transfer_failed(["w2", "w3"], "a pull failed mid-transfer")
    assert st.consistent is False and st.failures == {"transfer": 1}
    s = st.end()
    assert s["consistent"] is False and "2 parameters of a transfer that broke" in s["inconsistent_reason"]
    # A retry that writes them again inside the update makes it whole.
    st.begin()
    st.admit([(["w2", "w3"], A)])
    st.transfer_failed(["w2", "w3"], "broke again")
    _pull(st, ["w2", "w3"], A)
    assert st.end()["consistent"] is True


def test_parameters_of_a_broken_pull_may_be_written_again_by_another_writer():
    """A broken transfer's bytes are gone: whoever wrote those parameters
    before no longer owns them, and the writer that lands them completely
    makes the update whole."""
    st, _ = _state()
    st.begin()
    _pull(st, ["w1", "w2"], A)
    st.admit([(["w1", "w2"], A)])
    st.transfer_failed(["w1", "w2"], "a pull failed mid-transfer")
    assert st.in_progress()["params_written"] == 0
    _pull(st, ["w1", "w2"], B)  # no conflict: A's bytes there are gone
    with pytest.raises(WeightUpdateConflictError, match="'w1' was already written in this update by "
                                                        "actor TrainerB"):
        st.admit([(["w1"], A)])  # B's bytes now are not
    s = st.end()
    assert s["conflict"] is not None and s["consistent"] is False


def test_landed_pulls_are_summed_per_update_and_in_the_rank_totals():
    st, _ = _state()
    assert st.wrote_weights is False and st.update_kind is None
    st.begin()
    assert st.wrote_weights is False and st.update_kind == "session"  # open, nothing written
    st.admit([(["w1"], A), (["w2"], A)])
    st.landed([(["w1"], A), (["w2"], A)], _stats(2, 64, ("cma",)))
    st.admit([(["w1", "w3"], A)])
    st.landed([(["w1", "w3"], A)], _stats(2, 32, ("nixl", "cma")))
    assert st.wrote_weights is True
    assert st.in_progress() == {"kind": "session", "pulls": 2, "tensors": 4, "bytes": 96,
                                "params_written": 3, "writers": 1, "rewrites": 1, "conflict": None}
    totals = st.status()
    assert (totals["pulls"], totals["tensors"], totals["bytes"], totals["seconds"]) == (2, 4, 96, 1.0)
    assert totals["last_pull"]["bytes"] == 32
    s = st.end()
    assert s["transport"] == "cma,nixl" and s["transfer_seconds"] == pytest.approx(0.5)
    assert s["params_updated"] == 3 and s["rewrites"] == 1 and s["never_written"] == ["w4"]
    assert st.wrote_weights is False and st.status()["pulls"] == 2  # totals outlive the update


def test_a_broken_pull_counts_as_written_weights_and_a_failed_pull():
    st, _ = _state()
    st.begin()
    st.admit([(["w1"], A)])
    st.transfer_failed(["w1"], "broke")
    assert st.wrote_weights is True  # its bytes may have landed: the cache must be flushed
    assert st.status()["failed_pulls"] == 1 and st.status()["pulls"] == 0


def test_abort_leaves_touched_weights_inconsistent_and_untouched_ones_consistent():
    st, _ = _state()
    st.begin()
    st.abort("trainer gone")
    assert st.consistent is True and st.failed_updates == 1
    st.begin()
    _pull(st, ["w1"], A)
    status = st.abort("trainer gone")
    assert status["weights_consistent"] is False and status["inconsistent_reason"] == "trainer gone"
    assert status["update_open"] is False and st.failures["abort"] == 2


def test_pulls_under_a_plain_pause_open_an_update_that_a_session_then_adopts():
    st, _ = _state()
    _pull(st, ["w1"], A)
    assert st.update_kind == "paused"
    st.begin()
    assert st.update_kind == "session" and st.in_progress()["params_written"] == 1
    _pull(st, ["w2"], A)
    assert st.end()["params_updated"] == 2


def test_format_update_without_parameter_count():
    line = format_update({"tensors": 1, "bytes": 10, "pulls": 1, "transfer_seconds": 0.1,
                          "gbps": 1e-7, "update_seconds": 0.2, "transport": "cma",
                          "writers": 1, "params_updated": 1, "flushed_cache": True})
    assert "1 parameters updated by 1 writer" in line and "cache flushed=True" in line


def test_the_update_line_names_each_lora_adapter_and_its_bytes():
    line = format_update({"tensors": 4, "bytes": 4096, "pulls": 1, "transfer_seconds": 0.1, "gbps": 1e-5,
                          "update_seconds": 0.2, "transport": "cma", "writers": 1, "params_updated": 4,
                          "adapters": {"rl": 2048, "critic": 1024}})
    assert line.endswith(", LoRA rl: 2048 bytes, LoRA critic: 1024 bytes"), line
