"""LoRA adapter-only weight sync (sglang/srt/lora/adapter_stash.py, rdt/engine/lora_sync.py).

* fast: the expected PEFT tensors of a model's LoRA-wrapped layers; a rank's
  stash around a plain model (the standalone rank): register (created,
  unchanged, reconfigured), an adapter's tensors land next to the model's in
  one update and are served at its end, a refused update lands nothing (every
  checksum unchanged), a dropped one leaves the served adapter as it was;
* slow, real CPU servers from the CLI (sglang's model code, the torch_native
  LoRA backend; TP 1, and TP 2 over gloo): an adapter registered over HTTP
  and pushed over RDT serves exactly (greedy ids) what the same adapter
  loaded from disk with /load_lora_adapter serves; pushed again under the
  same name it serves the new one; the base output never changes.
"""

from __future__ import annotations

import json
import types

import pytest
import requests
import torch

from conftest import LORA_TARGETS, MemorySource
from sglang.srt.lora.adapter_stash import AdapterStashes, checksum, expected_tensors, split_name
from sglang.srt.ray.rdt.errors import WeightsInconsistentError, WeightSyncError

PROMPT = "the quick brown fox"
N = 8
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS, "bias": "none",
          "task_type": "CAUSAL_LM"}


# --------------------------------------------------------------------------- #
# The expected tensors and the stash
# --------------------------------------------------------------------------- #
def _wrapped(**base):
    return types.SimpleNamespace(base_layer=types.SimpleNamespace(**base))


def test_expected_tensors_are_the_peft_keys_of_every_targeted_layer_unsharded():
    layers = [{
        "model.layers.0.self_attn.qkv_proj": _wrapped(input_size=64, total_num_heads=4, total_num_kv_heads=2,
                                                      head_size=16, v_head_size=16),
        "model.layers.0.self_attn.o_proj": _wrapped(input_size=64, output_size=64),
        "model.layers.0.mlp.gate_up_proj": _wrapped(input_size=64, output_sizes=[128, 128]),
    }]
    out = expected_tensors(layers, ["q_proj", "v_proj", "gate_proj", "up_proj"], r=4)
    p = "base_model.model.model.layers.0"
    assert out == {
        f"{p}.self_attn.q_proj.lora_A.weight": (4, 64), f"{p}.self_attn.q_proj.lora_B.weight": (64, 4),
        f"{p}.self_attn.v_proj.lora_A.weight": (4, 64), f"{p}.self_attn.v_proj.lora_B.weight": (32, 4),
        f"{p}.mlp.gate_proj.lora_A.weight": (4, 64), f"{p}.mlp.gate_proj.lora_B.weight": (128, 4),
        f"{p}.mlp.up_proj.lora_A.weight": (4, 64), f"{p}.mlp.up_proj.lora_B.weight": (128, 4)}
    assert len(expected_tensors(layers, "all-linear", r=2)) == 2 * (3 + 1 + 2)
    assert split_name(f"rl:{p}.mlp.up_proj.lora_A.weight") == ("rl", f"{p}.mlp.up_proj.lora_A.weight")
    assert split_name("model.layers.0.mlp.up_proj.weight") is None


def test_a_stash_is_created_zeroed_kept_for_the_same_config_and_made_anew_for_another():
    stashes = AdapterStashes()
    layout = {"base_model.model.a.lora_A.weight": (2, 3), "base_model.model.a.lora_B.weight": (3, 2)}
    stash, what = stashes.register("rl", "id-1", CONFIG, layout, torch.float32, "cpu")
    assert what == "created" and all(int(t.abs().sum()) == 0 for t in stash.tensors.values())
    views = list(stash.tensors.values())
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()  # one buffer
    for t in views:
        t.fill_(1.0)
    assert stashes.register("rl", "id-2", CONFIG, layout, torch.float32, "cpu") == (stash, "unchanged")
    again, what = stashes.register("rl", "id-3", {**CONFIG, "r": 2}, layout, torch.float32, "cpu")
    assert what == "reconfigured" and again.lora_id == "id-1"  # the same id: its slot and cache namespace
    assert all(int(t.abs().sum()) == 0 for t in again.tensors.values())  # a new config starts zeroed


# --------------------------------------------------------------------------- #
# A rank's adapters (the standalone rank: the same core a SchedulerActor runs)
# --------------------------------------------------------------------------- #
LAYOUT = {"base_model.model.layer.q_proj.lora_A.weight": (2, 4), "base_model.model.layer.q_proj.lora_B.weight": (2, 2)}


@pytest.fixture
def rank():
    from sglang.test.rdt_standalone import ModelPort, standalone_rank

    model = torch.nn.Linear(4, 2)
    port = ModelPort(model, lora_layout=lambda config: LAYOUT)
    sync = standalone_rank(model, port=port, rank="lora", pull_timeout_s=5)
    port.is_paused = True
    yield sync
    sync.loop.stop()
    sync.shutdown()


def _adapter(value: float):
    return {f"rl:{k}": torch.full(s, value) for k, s in LAYOUT.items()}


def test_an_adapter_lands_next_to_the_model_and_is_served_at_the_updates_end(rank):
    out = rank.register_lora("rl", CONFIG, "id-1")
    assert out["status"] == "created" and out["expected_tensors"] == {f"rl:{k}": list(s) for k, s in LAYOUT.items()}
    assert out["dtype"] == "float32" and out["num_tensors"] == 2
    assert all(int(t.abs().sum()) == 0 for t in rank.port.lora_served["rl"].values())  # served zeroed
    adapter = _adapter(3.0)
    names = ["weight", "bias", *adapter]
    rank.pull_sources([MemorySource([torch.ones(2, 4), torch.ones(2), *adapter.values()])], names)
    assert all(int(t.abs().sum()) == 0 for t in rank.port.lora_served["rl"].values())  # not before the end
    out = rank.finalize("v1")
    assert out["update"]["adapters"] == {"rl": 48} and out["update"]["params_updated"] == 4  # (2x4 + 2x2 floats)
    assert out["update"]["params_total"] == 2  # (the model's own; an adapter's tensors are not)
    served = rank.port.lora_served["rl"]
    assert all(torch.equal(served[k.split(":", 1)[1]], t) for k, t in adapter.items())
    st = rank.status().lora_adapters["rl"]
    assert (st["version"], st["weight_version"], st["bytes"]) == (1, "v1", 48)
    assert st["checksum"] == checksum({k.split(":", 1)[1]: t for k, t in adapter.items()})


def test_metrics_count_each_served_adapter_and_its_bytes(rank):
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from sglang.srt.ray.rdt.engine import metrics

    reg = CollectorRegistry()
    metrics.configure(True, {"tp_rank": 0}, counter=partial(Counter, registry=reg),
                      histogram=partial(Histogram, registry=reg))
    try:
        rank.register_lora("rl", CONFIG, "id-1")
        for version in ("v1", "v2"):
            rank.port.is_paused = True
            rank.pull_sources([MemorySource(list(_adapter(1.0).values()))], list(_adapter(1.0)))
            rank.finalize(version)
        rank.port.is_paused = True
        rank.pull_sources([MemorySource([torch.ones(2, 4)])], ["weight"])  # the base model alone
        rank.finalize("v3")
    finally:
        metrics.configure(False)
    labels = {"tp_rank": "0", "adapter": "rl"}
    assert reg.get_sample_value("sglang:rdt_lora_adapter_updates_total", labels) == 2
    assert reg.get_sample_value("sglang:rdt_lora_adapter_bytes_total", labels) == 2 * 48
    assert reg.get_sample_value("sglang:rdt_weight_updates_total", {"tp_rank": "0"}) == 3


def test_a_refused_adapter_update_lands_nothing_anywhere(rank):
    rank.register_lora("rl", CONFIG, "id-1")
    before = rank.parameter_checksums()
    assert set(before) == {"weight", "bias", *_adapter(0)}  # the stash is checked too
    bad = {**_adapter(5.0)}
    key = next(iter(bad))
    bad[key] = torch.ones(3, 4)  # wrong shape
    with pytest.raises(WeightSyncError, match=r"rl:base_model.model.layer.q_proj.lora_A.weight"):
        rank.pull_sources([MemorySource([torch.ones(2, 4), *bad.values()])], ["weight", *bad])
    with pytest.raises(WeightSyncError, match="other:base_model"):  # an adapter nobody registered
        rank.pull_sources([MemorySource([torch.ones(2, 4)])], ["other:base_model.model.layer.q_proj.lora_A.weight"])
    assert rank.parameter_checksums() == before and rank.port.lora_served["rl"]["base_model.model.layer.q_proj.lora_A.weight"].sum() == 0


def test_a_dropped_update_leaves_the_served_adapter_and_its_stash_as_they_were(rank):
    rank.register_lora("rl", CONFIG, "id-1")
    rank.pull_sources([MemorySource(list(_adapter(2.0).values()))], list(_adapter(2.0)))
    rank.finalize("v1")
    served = {k: t.clone() for k, t in rank.port.lora_served["rl"].items()}
    rank.pull_sources([MemorySource(list(_adapter(9.0).values()))], list(_adapter(9.0)))
    rank.abort("trainer gone")
    assert rank.port.lora_served["rl"].keys() == served.keys()
    assert all(torch.equal(rank.port.lora_served["rl"][k], served[k]) for k in served)
    stash = rank.lora.stashes.stashes["rl"]
    assert all(float(t.flatten()[0]) == 2.0 for t in stash.tensors.values())  # what is served again
    assert rank.status().lora_adapters["rl"]["version"] == 1


def test_an_adapter_a_broken_pull_wrote_in_is_not_served_half_written(rank):
    """A pull into the adapter breaks after its first tensor landed; the update still ends (other work): the
    adapter is served as it was, and its stash holds that again, so a later partial update starts from it."""
    rank.register_lora("rl", CONFIG, "id-1")
    rank.pull_sources([MemorySource(list(_adapter(2.0).values()))], list(_adapter(2.0)))
    rank.finalize("v1")
    rank.port.is_paused = True
    with pytest.raises(WeightsInconsistentError):
        rank.pull_sources([MemorySource(list(_adapter(9.0).values()), fail_at=1)], list(_adapter(9.0)))
    with pytest.raises(WeightSyncError, match="inconsistent"):  # the update ends, reported not clean
        rank.finalize("v2")
    assert rank.status().lora_adapters["rl"]["version"] == 1
    assert all(float(t.flatten()[0]) == 2.0 for t in rank.port.lora_served["rl"].values())
    assert all(float(t.flatten()[0]) == 2.0 for t in rank.lora.stashes.stashes["rl"].tensors.values())


def test_sglang_serves_a_copy_that_later_updates_never_write(rank, monkeypatch):
    """sglang keeps the committed tensors themselves (no host copy): a later update writes the stash, never them,
    and an end whose adapter sglang refuses leaves the last copy served."""
    rank.register_lora("rl", CONFIG, "id-1")
    rank.pull_sources([MemorySource(list(_adapter(2.0).values()))], list(_adapter(2.0)))
    rank.finalize("v1")
    stash = rank.lora.stashes.stashes["rl"]
    held = stash.committed  # what sglang was handed
    assert not {t.data_ptr() for t in held.values()} & {t.data_ptr() for t in stash.tensors.values()}
    rank.port.is_paused = True
    rank.pull_sources([MemorySource(list(_adapter(9.0).values()))], list(_adapter(9.0)))
    assert all(float(t.flatten()[0]) == 9.0 for t in stash.tensors.values())
    assert all(bool((t == 2.0).all()) for t in held.values())

    served_sum = checksum({k.split(":", 1)[1]: t for k, t in _adapter(2.0).items()})
    seen = []

    def refuse(stash):
        seen.append(stash.checksum)  # a status read while sglang takes the new copy: still the served one's
        raise WeightSyncError("LoRA adapter rl: does not fit the memory pool")

    monkeypatch.setattr(rank.port, "lora_apply", refuse)
    with pytest.raises(WeightSyncError, match=r"inconsistent: .*'rl:base_model"):  # reported until rewritten
        rank.finalize("v2")
    assert stash.served.data_ptr() == next(iter(held.values())).data_ptr()  # the last copy, still served
    st = rank.status().lora_adapters["rl"]
    assert (st["version"], st["weight_version"]) == (1, "v1")
    assert seen == [served_sum] and st["checksum"] == served_sum


def test_an_adapter_sglang_refuses_to_serve_stays_as_it_was(rank, monkeypatch):
    rank.register_lora("rl", CONFIG, "id-1")
    before = rank.lora.stashes.stashes["rl"]

    def refuse(stash):
        raise WeightSyncError("LoRA adapter rl: does not fit the memory pool")

    monkeypatch.setattr(rank.port, "lora_apply", refuse)
    with pytest.raises(WeightSyncError, match="does not fit"):
        rank.register_lora("rl", {**CONFIG, "lora_alpha": 32}, "id-2")  # reconfigured, refused
    with pytest.raises(WeightSyncError, match="does not fit"):
        rank.register_lora("new", CONFIG, "id-3")  # created, refused
    assert rank.lora.stashes.stashes == {"rl": before}


# --------------------------------------------------------------------------- #
# Real servers
# --------------------------------------------------------------------------- #
def _write_adapter(path, tensors):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k.split(":", 1)[1]: t.contiguous() for k, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(CONFIG))
    return str(path)


def _random_adapter(expected, seed):
    g = torch.Generator().manual_seed(seed)
    return {name: 0.2 * torch.randn(*shape, generator=g) for name, shape in expected.items()}


def _generate(server, lora=None):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}
    if lora:
        body["lora_path"] = lora
    r = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _push_and_compare(server, ray_head, tmp_path, tp_size):
    from sglang.srt.ray.rdt import WeightSyncClient

    r = requests.post(f"{server.url}/register_lora_adapter", json={"lora_name": "rl", "config_dict": CONFIG},
                      timeout=120)
    assert r.status_code == 200 and r.json()["status"] in ("created", "unchanged"), r.text
    expected = r.json()["expected_tensors"]
    assert len(expected) == 2 * 7 * 2 and r.json()["dtype"] == "float32"  # 7 projections x 2 layers, A and B
    base = _generate(server)
    with WeightSyncClient.connect(port=server.port, namespace=ray_head.namespace, tp_size=tp_size) as client:
        client.register()
        for seed in (1, 2):  # pushed again under the same name: replaced in place
            adapter = _random_adapter(expected, seed)
            disk = f"disk-{tp_size}-{seed}"
            load = requests.post(f"{server.url}/load_lora_adapter",
                                 json={"lora_name": disk, "lora_path": _write_adapter(tmp_path / disk, adapter)},
                                 timeout=120)
            assert load.status_code == 200 and load.json()["success"], load.text
            stats = client.update(adapter, version=f"lora-{seed}")
            assert stats.tensors == len(expected) and stats.ranks == tp_size
            assert _generate(server, "rl") == _generate(server, disk) != base
            assert _generate(server) == base  # the base model is untouched
        statuses = client.status()
        sums = [s["lora_adapters"]["rl"] for s in statuses]
        assert all((s["version"] >= 2, s["weight_version"]) == (True, "lora-2") for s in sums)
        assert len({s["checksum"] for s in sums}) == 1  # every rank holds the same adapter
        assert sums[0]["checksum"] == checksum({k.split(":", 1)[1]: t for k, t in adapter.items()})

        # A refused update (a tensor of the wrong shape): nothing lands anywhere.
        before = [client.ranks[i].actor.get_parameter_checksums.remote() for i in range(tp_size)]
        import ray

        before = ray.get(before, timeout=120)
        bad = dict(_random_adapter(expected, 3))
        key = next(iter(bad))
        bad[key] = bad[key][:-1]
        with pytest.raises(WeightSyncError, match="rl:base_model.model.model.layers.0"):
            client.update(bad, version="never")
        after = ray.get([client.ranks[i].actor.get_parameter_checksums.remote() for i in range(tp_size)], timeout=120)
        assert after == before
        assert _generate(server, "rl") == _generate(server, f"disk-{tp_size}-2")


@pytest.mark.slow
def test_an_adapter_pushed_over_rdt_serves_what_the_same_adapter_from_disk_serves(
        ray_head, ray_client, lora_server, tmp_path):
    _push_and_compare(lora_server, ray_head, tmp_path, tp_size=1)


@pytest.mark.slow
def test_on_tp2_each_rank_serves_its_shard_of_the_pushed_adapter(ray_head, ray_client, tp2_server, tmp_path):
    _push_and_compare(tp2_server, ray_head, tmp_path, tp_size=2)
