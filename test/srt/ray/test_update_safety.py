"""Update safety on a real server: no torn weights, broken transfers, lifecycle.

The torn-weights and broken-transfer tests run against the session's shared
weight-sync server (``rdt_server``): each starts from whatever consistent
version it serves and leaves a consistent one behind. The
start/stop test starts and stops servers of its own, ``SGLANG_TEST_LIFECYCLE_CYCLES``
times (3 in ``make test``, 20 in ``make soak``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from conftest import live_actors, live_placement_groups, start_server, wait_until
from rdt_actors import ToyTrainer, actor_is_dead
from test_weight_sync_e2e import PROMPT, run_trainer_job, server_actors
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

RDT_ARGS = ["--backend", "ray", "--enable-rdt-weight-sync"]


def _server_args(head, *extra):
    return [*RDT_ARGS, "--ray-namespace", head.namespace, *extra]


@pytest.fixture
def server(rdt_server):
    return rdt_server


def test_generation_never_sees_torn_weights_during_syncs(server, tiny_model, ray_head):
    n = 10
    refs = {
        # Whatever this server serves now (no update is running).
        "old": server.output_ids(PROMPT, n),
        "A": hf_greedy(tiny_model, PROMPT, n, random_state_dict(tiny_model, 11)),
        "B": hf_greedy(tiny_model, PROMPT, n, random_state_dict(tiny_model, 12)),
    }
    assert len({tuple(v) for v in refs.values()}) == 3
    # (sent, answered, output ids) of every request, in completion order.
    outputs, errors = [], []
    stop = threading.Event()
    hammers = 4

    def hammer():
        deadline = time.monotonic() + 900
        while not stop.is_set() and time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                ids = tuple(server.output_ids(PROMPT, n))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))
                return
            outputs.append((sent, time.monotonic(), ids))

    def answered_since(t0: float, what: str) -> float:
        """Wait until every hammer could have sent a request after ``t0``:
        ``hammers`` requests sent after ``t0`` are answered. No update runs
        meanwhile, so each of them ran on the weights in place at ``t0``."""

        def enough():
            assert not errors, errors[:3]
            return sum(sent > t0 for sent, _, _ in list(outputs)) >= hammers

        wait_until(enough, 180, interval=0.05, what=f"{hammers} requests answered {what}")
        return time.monotonic()

    threads = [threading.Thread(target=hammer) for _ in range(hammers)]
    phases = []  # (expected version, start, end): no update ran in between
    t_start = time.monotonic()
    for t in threads:
        t.start()
    try:
        phases.append(("old", t_start, answered_since(t_start, "on the old weights")))
        for seed, version in [(11, "A1"), (12, "B1"), (11, "A2")]:
            run_trainer_job(ray_head, server, tiny_model, seed=seed, version=version)
            # The job returns after /weight_sync/end finalized the update.
            t_end = time.monotonic()
            phases.append((version[0], t_end, answered_since(t_end, f"after update {version}")))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:3]
    allowed = {tuple(v): k for k, v in refs.items()}
    seen = {allowed.get(o, "TORN") for _, _, o in outputs}
    assert "TORN" not in seen, f"{sum(o not in allowed for _, _, o in outputs)} outputs match no version"
    # Requests sent and answered between two updates saw exactly one version.
    for version, lo, hi in phases:
        got = [allowed.get(o, "TORN") for sent, done, o in outputs if lo < sent and done <= hi]
        assert len(got) >= hammers and set(got) == {version}, (version, got)
    assert {"old", "A", "B"} <= seen, seen  # the hammer really spanned the syncs
    assert server.output_ids(PROMPT, n) == refs["A"]


def _put_buckets(ray, layouts, state, chunks):
    import torch

    trainers, refs = [], []
    for chunk in chunks:
        tr = ToyTrainer.remote()
        tensors = [state[n].to(getattr(torch, layouts[n]["dtype"])).contiguous() for n in chunk]
        refs.append(ray.get(tr.put.remote(tensors))[0])
        trainers.append(tr)
    return trainers, refs


def test_broken_transfer_is_reported_until_a_complete_update_lands(
    server, tiny_model, ray_head, ray_client
):
    ray = ray_client
    (info,) = server_actors(ray, server)
    actor = ray.get_actor(info["Name"], namespace=server.arg("--ray-namespace"))
    layouts = ray.get(actor.get_parameter_layout.remote())
    names = list(layouts)
    chunks = [names[::2], names[1::2]]
    old_ids = server.output_ids(PROMPT, 12)
    version0 = server.generate(PROMPT, 4)["meta_info"]["weight_version"]

    # Bucket 2's trainer dies before the pull: bucket 1 lands, bucket 2 cannot.
    trainers, refs = _put_buckets(ray, layouts, random_state_dict(tiny_model, 21), chunks)
    pid = ray.get(trainers[1].pid.remote())
    ray.kill(trainers[1])
    wait_until(lambda: actor_is_dead(trainers[1], pid), 60, interval=0.1,
               what="bucket 2's trainer to die")
    # The lease outlasts the pull's own timeout (15 s): the pull fails, not the session.
    begin = requests.post(f"{server.url}/weight_sync/begin", json={"lease_s": 20}, timeout=60).json()
    with pytest.raises(Exception, match="inconsistent"):
        ray.get(actor.pull_weights.remote(refs, chunks, 15), timeout=120)
    status = ray.get(actor.get_weight_sync_status.remote())
    assert status["weights_consistent"] is False

    # The trainer never ends the session: the lease expires, serving resumes,
    # the version is unchanged, and the engine reports the inconsistency.
    r = requests.post(f"{server.url}/weight_sync/end",
                      json={"weight_version": "never", "session_id": "not-it"}, timeout=30)
    assert r.status_code == 409 and "not the open one" in r.json()["message"]
    wait_until(
        lambda: not requests.get(f"{server.url}/weight_sync/status", timeout=30).json()["update_open"],
        120, what="the lease to expire",
    )
    res = server.generate(PROMPT, 12)
    assert res["meta_info"]["weight_version"] == version0
    assert res["output_ids"] != old_ids  # half of the new weights did land
    info_json = requests.get(f"{server.url}/server_info", timeout=30).json()
    ws = info_json["weight_sync"]
    assert ws["weights_consistent"] is False and ws["inconsistent_reason"]
    assert ws["weight_version"] is None or ws["weight_version"] == version0
    late = requests.post(f"{server.url}/weight_sync/end", json={"session_id": begin["session_id"]}, timeout=30)
    assert late.status_code == 409

    # The next complete update succeeds and clears the state.
    out = run_trainer_job(ray_head, server, tiny_model, seed=22, version="fixed")
    assert out["status"][0]["weights_consistent"] is True
    ws = requests.get(f"{server.url}/server_info", timeout=30).json()["weight_sync"]
    assert ws["weights_consistent"] is True and ws["weight_version"] == "fixed"
    assert server.output_ids(PROMPT, 12) == hf_greedy(
        tiny_model, PROMPT, 12, random_state_dict(tiny_model, 22))
    ray.kill(trainers[0])


CYCLES = int(os.environ.get("SGLANG_TEST_LIFECYCLE_CYCLES", "3"))


@pytest.mark.timeout(180 * CYCLES)
def test_start_stop_cycles_with_kills_leave_nothing_behind(tiny_model, ray_head, ray_client, tmp_path):
    """Restarts on one port after SIGTERM, SIGINT and SIGKILL of the launcher.

    After a graceful stop the ranks released their NIXL registrations before
    they were killed; a caller still holding a rank's handle is refused with
    Ray's error for a dead actor, naming the rank."""
    from conftest import free_port

    ray = ray_client
    port = free_port()
    boot = str(free_port())
    # Placement groups of other servers (a module's shared one) are not ours.
    others = {pg["placement_group_id"] for pg in live_placement_groups(ray)}

    def leftovers():
        actors = [a["Name"] for a in live_actors(ray) if f"_port{port}_" in a["Name"]]
        groups = [pg["placement_group_id"] for pg in live_placement_groups(ray)
                  if pg["placement_group_id"] not in others]
        return actors, groups

    kinds = [("SIGKILL" if i % 3 == 2 else "SIGINT" if i % 3 == 1 else "SIGTERM") for i in range(CYCLES)]
    for i, kind in enumerate(kinds):
        server = start_server(
            tiny_model, ray_head,
            _server_args(ray_head, "--engine-info-bootstrap-port", boot),
            tmp_path, port=port, env={"SGLANG_RAY_OWNER_CHECK_INTERVAL": "1"},
        )
        try:
            assert len(server.output_ids(PROMPT, 2)) == 2
            (info,) = server_actors(ray, server)
            rank = ray.get_actor(info["Name"], namespace=ray_head.namespace)
            registered = ray.get(rank.register_weight_for_rdt.remote(), timeout=60)["registrations"]
            assert registered > 0
            if kind == "SIGKILL":
                # Kill the launcher and its children (as an OOM killer would).
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(timeout=30)
            else:
                server.proc.send_signal(getattr(signal, kind))
                rc = server.proc.wait(timeout=120)
                expected = (0,) if kind == "SIGTERM" else (0, -2, 130, 1)
                assert rc in expected, (rc, server.log()[-2000:])
                # The registrations were released before the actor was killed.
                assert f"[RDT] released {registered} NIXL registrations" in server.log()
        finally:
            server.terminate(timeout=10)
        # Orphaned detached actors notice their launcher is gone and exit.
        wait_until(lambda: leftovers() == ([], []), 60,
                   what=f"no actors/placement groups after cycle {i} ({kind})")
        # What a trainer still holding the rank's handle gets for a pull: Ray's
        # error for a dead actor, naming the rank (and, after a graceful stop,
        # the engine's kill).
        with pytest.raises(ray.exceptions.ActorDiedError) as died:
            ray.get(rank.pull_weights.remote([], []), timeout=60)
        message = str(died.value)
        assert f"name: {info['Name']}" in message, message
        assert kind == "SIGKILL" or "killed by `ray.kill`" in message, message
    assert leftovers() == ([], [])

