"""sglang's own model code (``--model-impl sglang``) on CPU through the Ray backend,
and HF-format weight updates resharded on the trainer side.

* fast: :class:`HFResharder` alone (replicas on this process, no server):
  ranks of one layout share one mapping; a bad HF name/shape/dtype or a fused
  parameter with a missing part is refused naming it;
* slow, one server per configuration (class-scoped, so only one runs at a time):
  a tiny Qwen3-MoE at TP 1 (Qwen3 attention with q/k norms, 4 experts, top-2)
  and a tiny Llama at TP 2 over gloo (``--device cpu --tp-size 2``). Each
  serves greedy output equal to transformers', answers
  ``/parallelism_config?rank=R`` per rank, refuses a bad HF update before any
  byte lands, and takes a good one through ``WeightSyncClient.update(...,
  layout="hf")`` -- after which its greedy output equals transformers' on the
  new checkpoint.
"""

from __future__ import annotations

import filecmp

import pytest
import requests
import torch

from conftest import start_server
from sglang.srt.ray.rdt import WeightSyncClient
from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer.hf_reshard import HFResharder, checkpoint_layout
from tiny_model import build_tiny_model, checkpoint_state_dict, hf_greedy

PROMPT = "the quick brown fox"
NATIVE_ARGS = ["--backend", "ray", "--model-impl", "sglang", "--enable-rdt-weight-sync"]


def rank_json(tp_rank, tp_size, dp_rank=None, dp_size=1):
    return dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                dp_rank=dp_rank, dp_size=dp_size, device="cpu")  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Served checkpoints (seed 0) and new checkpoints of the same layout (seed 1)."""
    root = tmp_path_factory.mktemp("native")
    out = {}
    for family in ("llama", "qwen3_moe"):
        out[family] = build_tiny_model(root / family, seed=0, family=family)
        out[family + "_new"] = build_tiny_model(root / f"{family}_new", seed=1, family=family)
        # Same tokenizer: the new checkpoint's HF reference reads the same ids.
        assert filecmp.cmp(out[family] / "tokenizer.json", out[family + "_new"] / "tokenizer.json")
    return out


# --------------------------------------------------------------------------- #
# The resharder alone (no server)
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def dp2_resharder(models):
    """An engine of DP 2 x TP 1: two ranks, one layout."""
    return HFResharder(
        models["llama"], {"dtype": "float32"},
        [rank_json(0, 1, dp_rank=0, dp_size=2), rank_json(0, 1, dp_rank=1, dp_size=2)],
    )


def test_ranks_of_one_layout_share_one_mapping_of_fused_params(dp2_resharder, models):
    sd = checkpoint_state_dict(models["llama_new"])
    per_rank = dp2_resharder.reshard(sd, strict=True)
    assert dp2_resharder.rank_groups() == [[0, 1]]
    assert per_rank[0] is per_rank[1]  # the client puts it once for both
    p = "model.layers.1"
    qkv = torch.cat([sd[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]])
    assert torch.equal(per_rank[0][f"{p}.self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(per_rank[0][f"{p}.mlp.gate_up_proj.weight"], gate_up)
    assert "model.layers.1.self_attn.q_proj.weight" not in per_rank[0]
    assert set(checkpoint_layout(models["llama"])) == set(sd)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda sd: sd.update({"model.layers.0.mlp.fc9.weight": torch.zeros(4)}),
         r"'model.layers.0.mlp.fc9.weight' is not a tensor of the checkpoint"),
        (lambda sd: sd.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 65)}),
         r"'model.layers.1.mlp.up_proj.weight': shape \(128, 65\) does not match the checkpoint's \(128, 64\)"),
        (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].double()}),
         r"'lm_head.weight': dtype float64; expected float32"),
        (lambda sd: sd.pop("model.layers.0.self_attn.v_proj.weight"),
         r"parameter 'model.layers.0.self_attn.qkv_proj.weight' .* missing: \['model.layers.0.self_attn.v_proj.weight'\]"),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype", "partial-fused-param"],
)
def test_bad_hf_state_dict_is_refused_naming_the_tensor(dp2_resharder, models, change, message):
    sd = checkpoint_state_dict(models["llama_new"])
    change(sd)
    replica = dp2_resharder.replica(dp2_resharder.keys[0])
    before = {n: p.detach().clone() for n, p in replica.params.items()}
    with pytest.raises(WeightSyncError, match=message):
        dp2_resharder.reshard(sd)
    # Refused before anything was loaded, even into the trainer-side replica.
    assert all(torch.equal(before[n], p) for n, p in replica.params.items())


# --------------------------------------------------------------------------- #
# Live servers: one per configuration
# --------------------------------------------------------------------------- #
class _LiveServer:
    family: str
    tp_size: int
    env: dict = {}

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, models, ray_head, tmp_path_factory):
        args = [*NATIVE_ARGS, "--ray-namespace", ray_head.namespace, "--tp-size", str(cls.tp_size)]
        server = start_server(
            models[cls.family], ray_head, args, tmp_path_factory.mktemp("logs"), env=cls.env
        )
        try:
            yield server
        finally:
            server.terminate()

    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, server, ray_client, ray_head):
        client = WeightSyncClient.connect(
            port=server.port, namespace=ray_head.namespace, tp_size=cls.tp_size,
            bucket_bytes=64 * 1024,
        )
        try:
            client.register()
            yield client
        finally:
            client.close()

    def test_greedy_output_equals_transformers(self, server, models):
        assert server.output_ids(PROMPT, 16) == hf_greedy(models[self.family], PROMPT, 16)
        # The last --model-impl wins (CPU_SERVER_ARGS name transformers first).
        impls = [v for flag, v in zip(server.args, server.args[1:]) if flag == "--model-impl"]
        assert impls[-1] == "sglang", impls

    def test_each_rank_serves_its_parallelism_config(self, server):
        for rank in range(self.tp_size):
            r = requests.get(f"{server.url}/parallelism_config", params={"rank": rank}, timeout=30)
            assert r.status_code == 200, r.text
            cfg = r.json()
            assert (cfg["rank"], cfg["tp_rank"], cfg["tp_size"], cfg["pp_size"], cfg["device"]) == (
                rank, rank, self.tp_size, 1, "cpu"), cfg
            assert (cfg["attn_tp_rank"], cfg["attn_tp_size"]) == (rank, self.tp_size), cfg
            assert (cfg["moe_tp_rank"], cfg["moe_ep_size"]) == (rank, 1), cfg
        r = requests.get(f"{server.url}/parallelism_config", params={"rank": self.tp_size}, timeout=30)
        assert r.status_code != 200

    def test_bad_hf_update_is_refused_before_a_byte_lands(self, server, client, models):
        before = server.output_ids(PROMPT, 16)
        sd = checkpoint_state_dict(models[self.family + "_new"])
        name = "model.layers.1.self_attn.q_proj.weight"
        with pytest.raises(WeightSyncError, match=f"'{name}': shape"):
            client.update({**sd, name: sd[name][:, :-1]}, version="bad-shape", layout="hf")
        with pytest.raises(WeightSyncError, match="'model.layers.1.self_attn.qq_proj.weight'"):
            client.update({**sd, "model.layers.1.self_attn.qq_proj.weight": sd[name]},
                          version="bad-name", layout="hf")
        status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
        assert (status["update_open"], status["updates"], status["failed_updates"]) == (False, 0, 0)
        assert server.output_ids(PROMPT, 16) == before == hf_greedy(models[self.family], PROMPT, 16)

    def test_hf_checkpoint_update_serves_the_new_weights(self, server, client, models):
        new = models[self.family + "_new"]
        expected = hf_greedy(new, PROMPT, 16)
        assert expected != hf_greedy(models[self.family], PROMPT, 16)
        stats = client.update(checkpoint_state_dict(new), version="hf-1", layout="hf", strict=True)
        assert stats.ranks == self.tp_size
        live = client.parameter_layouts()
        assert stats.tensors == sum(len(layout) for layout in live)  # every param of every rank
        res = server.generate(PROMPT, 16)
        assert res["output_ids"] == expected
        assert res["meta_info"]["weight_version"] == "hf-1"
        status = requests.get(f"{server.url}/weight_sync/status", timeout=30).json()
        assert (status["weights_consistent"], status["updates"]) == (True, 1)


@pytest.mark.slow
class TestQwen3MoeTP1(_LiveServer):
    family = "qwen3_moe"
    tp_size = 1


@pytest.mark.slow
class TestLlamaTP2OverGloo(_LiveServer):
    family = "llama"
    tp_size = 2
    # Two ranks on this 2-core box: one core each (as the dp-2 tests do).
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}

    def test_ranks_hold_different_shards(self, client):
        a, b = client.parameter_layouts()
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert a[qkv]["shape"] == b[qkv]["shape"] == [64, 64]  # (64 + 2 * 32) / 2 rows
