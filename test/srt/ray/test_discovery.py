"""A trainer that knows only the engine's URL and key (rdt/trainer/discovery.py,
``GET /weight_sync/ranks``), against a CLI server started with
``--api-key`` and ``--admin-api-key``, from a Ray job of its own in a
namespace of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import start_server
from tiny_model import hf_greedy, random_state_dict

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROMPT = "the quick brown fox"
USER_KEY, ADMIN_KEY = "user-key", "admin-key"


@pytest.fixture(scope="module")
def keyed_server(ray_head, ray_client, tiny_model, tmp_path_factory):
    s = start_server(tiny_model, ray_head, ["--backend", "ray", "--enable-rdt-weight-sync", "--ray-namespace",
                                            "hidden-namespace", "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY],
                     tmp_path_factory.mktemp("keyed"))
    yield s
    s.terminate()


def _generate(server):
    r = requests.post(f"{server.url}/generate", headers={"Authorization": f"Bearer {USER_KEY}"}, json={
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}},
        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _job(head, server, model, key, seed, version):
    proc = subprocess.run(
        [sys.executable, str(HERE / "url_trainer_job.py"), "--address", head.address, "--url", server.url,
         "--model", str(model), "--seed", str(seed), "--version", version, *(["--api-key", key] if key else [])],
        capture_output=True, text=True, timeout=300, env={**os.environ, **head.env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_the_rank_directory_needs_the_admin_key_and_names_no_secret(keyed_server):
    url = f"{keyed_server.url}/weight_sync/ranks"
    assert requests.get(url, timeout=60).status_code == 401
    assert requests.get(url, headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=60).status_code == 401
    r = requests.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    assert (d["namespace"], d["dp_size"], d["tp_size"], d["pp_size"]) == ("hidden-namespace", 1, 1, 1)
    (rank,) = d["ranks"]
    assert rank["actor_name"].startswith("sglang_scheduler_node") and f"_port{keyed_server.port}_" in rank["actor_name"]
    assert rank["parallelism"]["tp_rank"] == 0 and rank["namespace"] == "hidden-namespace"
    assert "token" not in r.text.lower() and ADMIN_KEY not in r.text


def test_a_trainer_with_only_the_url_and_the_admin_key_updates_the_engine(keyed_server, ray_head, tiny_model):
    before = _generate(keyed_server)
    refused = _job(ray_head, keyed_server, tiny_model, USER_KEY, seed=91, version="never")
    assert refused["error"] == "WeightSyncError", refused
    assert "HTTP 401" in refused["message"] and "--admin-api-key" in refused["message"], refused
    assert _generate(keyed_server) == before  # nothing moved
    out = _job(ray_head, keyed_server, tiny_model, ADMIN_KEY, seed=92, version="by-url")
    assert "error" not in out, out
    assert out["namespace"] != "hidden-namespace" and len(out["ranks"]) == 1
    assert _generate(keyed_server) == hf_greedy(tiny_model, PROMPT, 12, random_state_dict(tiny_model, 92))
    st = requests.get(f"{keyed_server.url}/weight_sync/status", headers={"Authorization": f"Bearer {USER_KEY}"},
                      timeout=60).json()
    assert (st["weight_version"], st["weights_consistent"]) == ("by-url", True)
