"""miles' RDT weight sync against the fork, unchanged: its calls, shapes and lifecycle.

Our code reproducing the call sequence of miles' trainer (radixark/miles PR
#1313): discovery of the SchedulerActors (scan of named actors, names rebuilt
with the seed's keyword spelling), connect (``/parallelism_config?rank=R`` on
the engine's HTTP port, ``register_weight_for_rdt``), then per update sglang's
own lifecycle — ``/pause_generation``, ``/flush_cache``,
``/begin_weight_update {"selector": "all"}``, rounds of
``pull_weights.remote([ref], names)`` from one registered bucket,
``/update_weight_version`` (twice, as miles sends it), ``/end_weight_update``,
``/continue_generation``. One server serves every test of this file.

Also here: a pull after a pause in each mode is accepted, without one it is
refused; and the no-silent-mix rule (two trainers writing the same parameter
in one update).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import requests

from conftest import start_server, wait_until
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
N = 12


@pytest.fixture(scope="module")
def server(ray_head, ray_client, tiny_model, tmp_path_factory):
    s = start_server(
        tiny_model, ray_head,
        ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace", ray_head.namespace,
         "--enable-metrics"],
        tmp_path_factory.mktemp("miles-server"),
        idle_sleep=False,  # miles' own flags: sglang's default idle loop
    )
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def rank(server, ray_client, ray_head):
    """The rank found the two ways miles has found it."""
    ray = ray_client
    from sglang.srt.ray import get_scheduler_actor_name

    scanned = [
        (e["name"], e["namespace"]) for e in ray.util.list_named_actors(all_namespaces=True)
        if e["name"].startswith("sglang_scheduler_node") and f"_port{server.port}_" in e["name"]
    ]
    assert len(scanned) == 1, scanned
    name = get_scheduler_actor_name(
        rank0_node_ip=ray.util.get_node_ip_address(), dp_rank=0, pp_rank=0, tp_rank=0,
        port=server.port, bundle_idx=0,
    )
    assert scanned == [(name, ray_head.namespace)]
    actor = ray.get_actor(name, namespace=ray_head.namespace)
    ray.get(actor.register_weight_for_rdt.remote(), timeout=120)
    ray.get(actor.register_weight_for_rdt.remote(), timeout=120)  # on every reconnect
    return actor


@pytest.fixture(scope="module")
def layout(rank, ray_client):
    return ray_client.get(rank.get_parameter_layout.remote(), timeout=60)


def _post(server, path, body=None, ok=True):
    r = requests.post(f"{server.url}{path}", json=body or {}, timeout=120)
    if ok:
        assert r.status_code == 200, (path, r.status_code, r.text)
    return r


def _tensors(tiny_model, layout, seed, names=None):
    import torch

    new = random_state_dict(tiny_model, seed)
    names = list(layout) if names is None else names
    return {n: new[n].to(getattr(torch, layout[n]["dtype"])).contiguous() for n in names}


def _trainer(ray, layout, bucket_bytes=None):
    from miles_actors import MilesLikeTrainer

    # 8 bytes per element: room for any dtype of the layout
    total = sum(math.prod(v["shape"]) * 8 for v in layout.values())
    return MilesLikeTrainer.remote(bucket_bytes or total)


def _pull(ray, rank, trainer, tensors):
    (ref,) = ray.get(trainer.stage_and_put.remote(tensors), timeout=60)
    return ray.get(rank.pull_weights.remote([ref], list(tensors)), timeout=120)


def _rounds(names, n):
    return [names[i::n] for i in range(n)]


def _miles_update(server, ray, rank, trainer, tensors, version, mode="retract", rounds=2):
    _post(server, "/pause_generation", {"mode": mode})
    if mode != "in_place":
        assert requests.get(f"{server.url}/flush_cache", timeout=60).status_code == 200
    _post(server, "/begin_weight_update", {"selector": "all"}).json()
    names = list(tensors)
    for chunk in _rounds(names, rounds):
        _pull(ray, rank, trainer, {n: tensors[n] for n in chunk})
    for _ in range(2):  # miles sends the version twice, before the end
        _post(server, "/update_weight_version", {"new_version": version}).json()
    end = _post(server, "/end_weight_update", ok=False)
    _post(server, "/continue_generation")
    return end


def _begin(server):
    _post(server, "/pause_generation", {"mode": "retract"})
    _post(server, "/begin_weight_update", {"selector": "all"})


def _two_writers(ray, layout, tiny_model, seed_a, seed_b):
    """Trainers A and B, the layout's two halves, and A's and B's new weights."""
    names = list(layout)
    half = len(names) // 2
    return (_trainer(ray, layout), _trainer(ray, layout), names[:half], names[half:],
            _tensors(tiny_model, layout, seed_a), _tensors(tiny_model, layout, seed_b))


def _checksums(ray, rank):
    return ray.get(rank.get_parameter_checksums.remote(), timeout=60)


def test_miles_update_cycle_through_sglangs_lifecycle(server, rank, layout, ray_client, tiny_model):
    ray = ray_client
    # Connect: the parallelism config on the HTTP port == the bootstrap server's.
    cfg = requests.get(f"{server.url}/parallelism_config", params={"rank": 0}, timeout=10).json()
    boot = server.arg("--engine-info-bootstrap-port")
    assert cfg == requests.get(
        f"http://127.0.0.1:{boot}/parallelism_config", params={"rank": 0}, timeout=10).json()
    assert cfg == ray.get(rank.get_parallelism_config.remote(), timeout=30)
    assert (cfg["tp_size"], cfg["tp_rank"], cfg["dp_size"], cfg["rank"]) == (1, 0, 1, 0)
    # miles hands that JSON to the trainer-side replica API as is.
    from sglang.srt.distributed.parallel_state import RankParallelismConfig

    assert RankParallelismConfig.from_dict(cfg).to_dict() == cfg
    # ... and rebuilds the engine's server args from /server_info, the dataclass way.
    from sglang.srt.server_args import ServerArgs

    info = requests.get(f"{server.url}/server_info", timeout=30).json()
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert fields == set(ServerArgs.__struct_fields__)
    rebuilt = ServerArgs(**{k: v for k, v in info.items() if k in fields})
    assert (rebuilt.model_path, rebuilt.port) == (str(tiny_model), server.port)
    missing = requests.get(f"{server.url}/parallelism_config", params={"rank": 5}, timeout=10)
    assert missing.status_code == 404 and "registered ranks: [0]" in missing.text

    trainer = _trainer(ray, layout)
    ptrs = {n: v["data_ptr"] for n, v in layout.items()}
    assert server.output_ids(PROMPT, N) == hf_greedy(tiny_model, PROMPT, N)
    for i, seed in enumerate((31, 32), start=1):
        tensors = _tensors(tiny_model, layout, seed)
        end = _miles_update(server, ray, rank, trainer, tensors, f"miles-{i}")
        assert end.status_code == 200 and end.json()["success"] is True, end.text
        res = server.generate(PROMPT, N)
        assert res["output_ids"] == hf_greedy(tiny_model, PROMPT, N, random_state_dict(tiny_model, seed))
        assert res["meta_info"]["weight_version"] == f"miles-{i}"
        assert requests.get(f"{server.url}/model_info", timeout=10).json()["weight_version"] == f"miles-{i}"
        # The rank recorded the update (sglang's lifecycle is the fork's lifecycle).
        stats = ray.get(rank.get_weight_sync_stats.remote(), timeout=30)
        last = stats["last_update"]
        assert (last["weight_version"], last["pulls"], last["tensors"]) == (f"miles-{i}", 2, len(layout))
        assert (last["params_updated"], last["params_total"], last["writers"]) == (len(layout),) * 2 + (1,)
        assert last["consistent"] is True and last["never_written"] == []
    assert {n: v["data_ptr"] for n, v in ray.get(rank.get_parameter_layout.remote()).items()} == ptrs
    status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert (status["weights_consistent"], status["weight_version"], status["update_open"]) == (
        True, "miles-2", False)
    def done_lines():
        return [l for l in server.log().splitlines() if "[RDT] weight update dp0/pp0/tp0 done" in l
                and "weight_version=miles-2" in l]

    (line,) = wait_until(done_lines, 60, what="the update's log line")
    assert f"weight_version=miles-2 tensors={len(layout)} " in line
    assert f"{len(layout)} of {len(layout)} parameters updated by 1 writer" in line
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    updates = re.search(r'^sglang:rdt_weight_updates_total\{[^}]*tp_rank="0"[^}]*\} ([\d.]+)', text, re.M)
    assert updates and float(updates.group(1)) >= 2, text[-2000:]
    ray.kill(trainer)


def test_pull_after_pause_in_every_mode_is_accepted_and_refused_without(
    server, rank, layout, ray_client, tiny_model
):
    ray = ray_client
    trainer = _trainer(ray, layout)
    names = list(layout)
    refused = None
    try:
        _pull(ray, rank, trainer, _tensors(tiny_model, layout, 40, names[:1]))
    except ray.exceptions.RayTaskError as e:
        refused = str(e)
    assert refused and "refusing to pull weights while generation may run" in refused
    assert "generation is not paused" in refused
    before = ray.get(rank.get_weight_sync_stats.remote(), timeout=30)["updates"]
    for k, mode in enumerate(("abort", "retract", "in_place")):
        seed = 41 + k
        _post(server, "/pause_generation", {"mode": mode})
        if mode != "in_place":  # as miles does; after in_place the rank flushes itself
            assert requests.get(f"{server.url}/flush_cache", timeout=60).status_code == 200
        _pull(ray, rank, trainer, _tensors(tiny_model, layout, seed))
        # Continue without begin/end: the update made under the pause ends.
        _post(server, "/continue_generation")
        assert server.output_ids(PROMPT, N) == hf_greedy(
            tiny_model, PROMPT, N, random_state_dict(tiny_model, seed)), mode
    stats = ray.get(rank.get_weight_sync_stats.remote(), timeout=30)
    assert stats["updates"] == before + 3 and stats["last_update"]["consistent"] is True
    ray.kill(trainer)


def test_two_trainers_writing_disjoint_halves_make_one_clean_update(
    server, rank, layout, ray_client, tiny_model
):
    ray = ray_client
    a, b, first, second, new_a, new_b = _two_writers(ray, layout, tiny_model, 51, 52)
    _begin(server)
    _pull(ray, rank, a, {n: new_a[n] for n in first})
    _pull(ray, rank, b, {n: new_b[n] for n in second})
    _post(server, "/update_weight_version", {"new_version": "two-writers"})
    end = _post(server, "/end_weight_update")
    _post(server, "/continue_generation")
    assert end.json()["success"] is True
    combined = {**random_state_dict(tiny_model, 51)}
    combined.update({n: random_state_dict(tiny_model, 52)[n] for n in second})
    assert server.output_ids(PROMPT, N) == hf_greedy(tiny_model, PROMPT, N, combined)
    last = ray.get(rank.get_weight_sync_stats.remote(), timeout=30)["last_update"]
    assert (last["writers"], last["params_updated"], last["consistent"]) == (2, len(layout), True)
    for t in (a, b):
        ray.kill(t)


def test_same_parameters_from_two_trainers_in_one_update_are_refused_and_reported(
    server, rank, layout, ray_client, tiny_model
):
    ray = ray_client
    a, b, first, second, new_a, new_b = _two_writers(ray, layout, tiny_model, 61, 62)
    a_id, b_id = ray.get(a.actor_id.remote()), ray.get(b.actor_id.remote())
    _begin(server)
    _pull(ray, rank, a, {n: new_a[n] for n in first})        # A's first half
    before = _checksums(ray, rank)
    with pytest.raises(ray.exceptions.RayTaskError) as e:    # B's first half: refused
        _pull(ray, rank, b, {n: new_b[n] for n in first})
    msg = str(e.value)
    assert "WeightUpdateConflictError" in msg and f"{first[0]!r}" in msg
    assert a_id[:12] in msg and b_id[:12] in msg
    assert _checksums(ray, rank) == before                    # nothing of it landed
    _pull(ray, rank, b, {n: new_b[n] for n in second})       # B's second half: nobody wrote it
    with pytest.raises(ray.exceptions.RayTaskError, match="already written in this update"):
        _pull(ray, rank, a, {n: new_a[n] for n in second})   # A's second half: refused
    status = ray.get(rank.get_weight_sync_status.remote(), timeout=30)
    assert status["weights_consistent"] is False and status["update_in_progress"]["conflict"]
    _post(server, "/update_weight_version", {"new_version": "mixed"})
    end = _post(server, "/end_weight_update", ok=False)
    assert end.status_code == 400 and "already written in this update" in end.json()["message"]
    _post(server, "/continue_generation")
    ws = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert ws["weights_consistent"] is False and "already written" in ws["inconsistent_reason"]
    assert ws["update_open"] is False
    # The rank's error line reaches the server's log through Ray's log forwarding.
    wait_until(lambda: "parameters updated by 2 writers" in server.log()
               and "; weights inconsistent: parameter" in server.log(), 60,
               what="the inconsistent update's log line")

    # One writer re-sending a bucket is fine (a retry); the clean update clears the state.
    tensors = _tensors(tiny_model, layout, 63)
    _begin(server)
    _pull(ray, rank, a, {n: tensors[n] for n in first})
    _pull(ray, rank, a, {n: tensors[n] for n in first})
    _pull(ray, rank, a, {n: tensors[n] for n in second})
    _post(server, "/update_weight_version", {"new_version": "clean"})
    assert _post(server, "/end_weight_update").json()["success"] is True
    _post(server, "/continue_generation")
    last = ray.get(rank.get_weight_sync_stats.remote(), timeout=30)["last_update"]
    assert (last["rewrites"], last["writers"], last["consistent"]) == (len(first), 1, True)
    ws = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert ws["weights_consistent"] is True and ws["weight_version"] == "clean"
    assert server.output_ids(PROMPT, N) == hf_greedy(
        tiny_model, PROMPT, N, random_state_dict(tiny_model, 63))
    for t in (a, b):
        ray.kill(t)


def test_a_session_opened_without_a_pause_refuses_pulls_and_serves_the_old_weights(
    server, rank, layout, ray_client, tiny_model
):
    """/begin_weight_update alone: requests keep running, so a pull (which
    would let them see a partly written model) is refused naming the fix,
    nothing lands, and what is served is the old checkpoint."""
    ray = ray_client
    trainer = _trainer(ray, layout)
    before = server.output_ids(PROMPT, N)
    checksums = _checksums(ray, rank)
    names = list(layout)
    _post(server, "/begin_weight_update", {"selector": "all"})
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        _pull(ray, rank, trainer, _tensors(tiny_model, layout, 71, names[: len(names) // 2]))
    assert "session is open but generation is not paused" in str(e.value)
    assert "POST /pause_generation" in str(e.value)
    assert server.output_ids(PROMPT, N) == before  # served meanwhile, from the old weights
    assert _checksums(ray, rank) == checksums
    assert _post(server, "/end_weight_update").json()["success"] is True  # nothing was written
    ws = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
    assert ws["weights_consistent"] is True and ws["update_open"] is False
    ray.kill(trainer)


def test_a_request_sent_between_two_buckets_is_answered_by_the_complete_new_model(
    server, rank, layout, ray_client, tiny_model
):
    """miles' flow (pause, begin, bucket, bucket, end, continue) with a request
    arriving after the first bucket: it waits, and is answered only once the
    update ended, by the new checkpoint, never by the half-written one."""
    import concurrent.futures

    ray = ray_client
    trainer = _trainer(ray, layout)
    seed = 72
    tensors = _tensors(tiny_model, layout, seed)
    first, second = _rounds(list(tensors), 2)
    _post(server, "/pause_generation", {"mode": "retract"})
    _post(server, "/begin_weight_update", {"selector": "all"})
    _pull(ray, rank, trainer, {n: tensors[n] for n in first})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.output_ids, PROMPT, N)
        _pull(ray, rank, trainer, {n: tensors[n] for n in second})
        _post(server, "/update_weight_version", {"new_version": "between-buckets"})
        assert _post(server, "/end_weight_update").json()["success"] is True
        assert not answer.done()  # held while generation is paused
        _post(server, "/continue_generation")
        got = answer.result(timeout=120)
    assert got == hf_greedy(tiny_model, PROMPT, N, random_state_dict(tiny_model, seed))
    ray.kill(trainer)
