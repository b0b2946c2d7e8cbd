"""The sglang API a trainer imports to reshard weights for one engine rank.

miles (radixark/miles PR #1313, update_weight_from_rdt.py / p2p.py) builds, per
engine rank, a dummy-loaded sglang model replica with that rank's layout and
loads its Hugging Face tensors with the model's own ``load_weights``:

    server_args.override("...local_replica", nnodes=1)
    set_global_server_args_for_scheduler(server_args)
    initialize_moe_config(server_args); initialize_fp8_gemm_config(server_args)
    initialize_fp4_gemm_config(server_args)
    with ParallelismContext(RankParallelismConfig.from_dict(<GET /parallelism_config?rank=R>)):
        model = get_model(model_config=..., load_config=LoadConfig("dummy"), device_config=...)
    mapper = ParameterMapper.from_model(model)   # .map(hf).sglang_name/.num_shards/.num_local_experts
    model.load_weights(hf_tensors)                # outside the context

These tests do exactly that on CPU with tiny local Llama / Qwen3 / Qwen3-MoE
configs (no server, no process group, nothing downloaded).
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

from sglang.srt import server_args as server_args_module
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import (
    ParallelismContext,
    RankParallelismConfig,
)
from sglang.srt.layers.moe import initialize_moe_config
from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
from sglang.srt.model_loader import get_model
from sglang.srt.model_loader.parameter_mapper import (
    ParameterMapper,
    ParameterMappingError,
)
from sglang.srt.runtime_context import (
    get_context,
    get_parallel,
    reset_context,
    restore_context,
    snapshot_context,
)
from sglang.srt.server_args import ServerArgs

from tiny_model import build_tiny_model, random_state_dict, tiny_config

# One rank's JSON as served at GET /parallelism_config?rank=R (tp 2, rank 1).
RANK_JSON = {
    "tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1,
    "dp_rank": None, "dp_size": 1,
    "attn_tp_rank": 1, "attn_tp_size": 2, "attn_dp_rank": 0, "attn_dp_size": 1,
    "attn_cp_rank": 0, "attn_cp_size": 1,
    "moe_ep_rank": 0, "moe_ep_size": 1, "moe_tp_rank": 1, "moe_tp_size": 2,
    "moe_dp_rank": 0, "moe_dp_size": 1,
    "node_rank": 0, "nnodes": 1, "world_rank": 1, "world_size": 2,
    "device": "cpu", "device_id": None, "rank": 1,
}  # fmt: skip

# Names get_parallel() answers about a rank, and what the context must restore.
PARALLEL_NAMES = (
    "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size",
    "attn_tp_rank", "attn_tp_size", "attn_dp_rank", "attn_dp_size",
    "attn_cp_rank", "attn_cp_size", "moe_ep_rank", "moe_ep_size",
    "moe_tp_rank", "moe_tp_size", "moe_dp_rank", "moe_dp_size",
    "node_rank", "nnodes", "launch_world_rank", "launch_world_size",
    "tp_group", "pp_group", "attn_tp_group", "moe_ep_group", "world_group",
)  # fmt: skip

def rank_cfg(tp_rank: int, tp_size: int, **more) -> RankParallelismConfig:
    return RankParallelismConfig.from_dict(dict(tp_rank=tp_rank, tp_size=tp_size, **more))


def parallel_state():
    """Every PARALLEL_NAMES answer (value, or the exception type raised)."""
    out = {}
    for name in PARALLEL_NAMES:
        try:
            out[name] = ("value", getattr(get_parallel(), name))
        except Exception as e:  # an unset rank raises; that is state too
            out[name] = ("raises", type(e))
    return out


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _own_runtime_context():
    """Publishing is process-global: put back whatever was there before."""
    saved = snapshot_context()
    yield
    restore_context(saved)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The Llama with weights and a tokenizer; the Qwen3 families as configs only."""
    root = tmp_path_factory.mktemp("trainer_side")
    dirs = {"llama": build_tiny_model(root / "llama")}
    for family in ("qwen3", "qwen3_moe"):
        dirs[family] = root / family
        tiny_config(family, vocab_size=256).save_pretrained(str(dirs[family]))
    return dirs


def engine_server_args(model_dir: Path, **more) -> ServerArgs:
    """What the trainer rebuilds from the engine's /server_info."""
    return ServerArgs(
        model_path=str(model_dir), device="cpu", skip_tokenizer_init=True, **more
    )


def build_replica(model_dir: Path, cfg: RankParallelismConfig, server_args: ServerArgs):
    """The trainer's replica of one engine rank, built the way miles builds it."""
    if server_args.nnodes > 1:
        server_args.override("test.local_replica", nnodes=1)
    server_args_module.set_global_server_args_for_scheduler(server_args)
    initialize_moe_config(server_args)
    initialize_fp8_gemm_config(server_args)
    initialize_fp4_gemm_config(server_args)
    with ParallelismContext(cfg):
        return get_model(
            model_config=ModelConfig(str(model_dir), dtype="float32"),
            load_config=LoadConfig(load_format="dummy", model_loader_extra_config=None),
            device_config=DeviceConfig(device="cpu"),
        )


_REPLICAS = {}


def replica(model_dirs, family: str, tp_rank: int, tp_size: int, **more):
    key = (family, tp_rank, tp_size, tuple(sorted(more.items())))
    if key not in _REPLICAS:
        widths = {"ep_size": more.get("moe_ep_size", 1), "pp_size": more.get("pp_size", 1)}
        sa = engine_server_args(model_dirs[family], tp_size=tp_size, **widths)
        _REPLICAS[key] = build_replica(
            model_dirs[family], rank_cfg(tp_rank, tp_size, **more), sa
        )
    return _REPLICAS[key]


def hf_state_dict(model_dirs, family: str, seed: int = 1):
    """Checkpoint-layout tensors (per-expert names for MoE, as on the hub)."""
    if family == "llama":
        return random_state_dict(model_dirs["llama"], seed)
    from transformers import AutoConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dirs[family]))
    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if family == "qwen3" else Qwen3MoeForCausalLM
    sd = {k: v.clone() for k, v in cls(cfg).state_dict().items() if ".experts." not in k}
    if family == "qwen3_moe":
        gen = torch.Generator().manual_seed(seed)
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        for layer in range(cfg.num_hidden_layers):
            for e in range(cfg.num_experts):
                p = f"model.layers.{layer}.mlp.experts.{e}"
                sd[f"{p}.gate_proj.weight"] = torch.randn(inter, hidden, generator=gen)
                sd[f"{p}.up_proj.weight"] = torch.randn(inter, hidden, generator=gen)
                sd[f"{p}.down_proj.weight"] = torch.randn(hidden, inter, generator=gen)
    return sd


# ------------------------------------------------------ RankParallelismConfig


def test_rank_config_round_trips_the_served_json():
    cfg = RankParallelismConfig.from_dict(RANK_JSON)
    assert cfg.to_dict() == RANK_JSON
    assert list(cfg.to_dict()) == list(RANK_JSON)  # the served key order too
    again = RankParallelismConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert (cfg.tp_rank, cfg.tp_size, cfg.dp_rank, cfg.device) == (1, 2, None, "cpu")


def test_rank_config_keeps_unknown_keys_and_rejects_bad_values():
    newer = dict(RANK_JSON, dcp_rank=0)
    cfg = RankParallelismConfig.from_dict(newer)
    assert cfg.extra == {"dcp_rank": 0} and cfg.to_dict() == newer

    with pytest.raises(ValueError, match="tp_rank=2 is not a rank of tp_size=2"):
        RankParallelismConfig.from_dict(dict(RANK_JSON, tp_rank=2))
    with pytest.raises(TypeError, match="tp_rank must be an int"):
        RankParallelismConfig.from_dict(dict(RANK_JSON, tp_rank="1"))
    with pytest.raises(TypeError, match="moe_ep_size must be an int"):
        RankParallelismConfig.from_dict(dict(RANK_JSON, moe_ep_size=True))
    with pytest.raises(ValueError, match="all-ranks listing"):
        RankParallelismConfig.from_dict({"ranks": {"0": RANK_JSON}})
    with pytest.raises(ValueError, match="do not factor"):
        ParallelismContext(dict(RANK_JSON, attn_dp_size=2))


def test_rank_config_derives_what_is_missing():
    lay = rank_cfg(3, 4, attn_dp_size=2, moe_ep_size=2).layout()
    assert (lay["attn_tp_size"], lay["attn_tp_rank"], lay["attn_dp_rank"]) == (2, 1, 1)
    assert (lay["moe_tp_size"], lay["moe_tp_rank"], lay["moe_ep_rank"]) == (2, 1, 1)
    assert (lay["world_rank"], lay["world_size"], lay["dp_rank"]) == (3, 4, None)
    with pytest.raises(ValueError, match="tp_rank is missing"):
        RankParallelismConfig.from_dict({"tp_size": 2}).layout()


def test_context_publishes_what_the_engine_serves(model_dirs):
    """Inside the context, the engine's own /parallelism_config reader gives back the JSON."""
    from sglang.srt.model_executor.parallelism_config import read_parallelism_config

    server_args_module.set_global_server_args_for_scheduler(
        engine_server_args(model_dirs["llama"], tp_size=2)
    )
    with ParallelismContext(RANK_JSON):
        assert read_parallelism_config(None, "cpu") == RANK_JSON


# ------------------------------------------------------- ParallelismContext


def test_context_sets_rank_and_restores_on_exit_and_on_error(model_dirs):
    server_args_module.set_global_server_args_for_scheduler(
        engine_server_args(model_dirs["llama"], tp_size=2)
    )
    before = parallel_state()
    with ParallelismContext(rank_cfg(1, 2)) as ctx:
        p = get_parallel()
        assert (p.tp_rank, p.tp_size, p.attn_tp_rank, p.moe_tp_rank) == (1, 2, 1, 1)
        assert (p.tp_group.rank_in_group, p.tp_group.world_size) == (1, 2)
        assert p.pp_group.is_first_rank and p.pp_group.is_last_rank
        assert p.tp_group.cpu_group is None and p.tp_group.use_pynccl is False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from sglang.srt.distributed import parallel_state as ps

            assert ps.get_tensor_model_parallel_rank() == 1
            assert ps.get_tensor_model_parallel_world_size() == 2
        with pytest.raises(RuntimeError, match="no process group"):
            p.tp_group.all_reduce(torch.zeros(1))
        # Nesting: the inner rank is in effect, the outer one comes back.
        with ParallelismContext(rank_cfg(0, 4)):
            assert (get_parallel().tp_rank, get_parallel().tp_size) == (0, 4)
        assert (get_parallel().tp_rank, get_parallel().tp_size) == (1, 2)
        assert ctx.config.tp_rank == 1
    assert parallel_state() == before

    with pytest.raises(KeyError):
        with ParallelismContext(rank_cfg(1, 2)):
            assert get_parallel().tp_rank == 1
            raise KeyError("boom")
    assert parallel_state() == before


def test_context_serializes_threads():
    seen = []

    def other():
        with ParallelismContext(rank_cfg(0, 2)):
            seen.append(get_parallel().tp_rank)

    with ParallelismContext(rank_cfg(1, 2)):
        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=0.5)
        assert t.is_alive() and seen == []  # waits for this context to exit
        assert get_parallel().tp_rank == 1
    t.join(timeout=10)
    assert seen == [0]


# ------------------------------------------------ replicas and ParameterMapper


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mapper_maps_hf_names_to_fused_params_with_shard_counts(model_dirs, family):
    model = replica(model_dirs, family, 0, 1)
    mapper = ParameterMapper.from_model(model)
    params = dict(model.named_parameters())
    for name in hf_state_dict(model_dirs, family):
        m = mapper.map(name)
        assert m.sglang_name in params, (name, m)
    m = mapper.map("model.layers.1.self_attn.k_proj.weight")
    assert (m.sglang_name, m.shard_id, m.num_shards) == (
        "model.layers.1.self_attn.qkv_proj.weight", "k", 3,
    )
    m = mapper.map("model.layers.0.mlp.up_proj.weight")
    assert (m.sglang_name, m.shard_id, m.num_shards) == (
        "model.layers.0.mlp.gate_up_proj.weight", 1, 2,
    )
    m = mapper.map("model.layers.0.mlp.down_proj.weight")
    assert (m.sglang_name, m.shard_id, m.num_shards, m.num_local_experts) == (
        "model.layers.0.mlp.down_proj.weight", None, 1, None,
    )
    with pytest.raises(ParameterMappingError, match="model.layers.0.mlp.fc9.weight"):
        mapper.map("model.layers.0.mlp.fc9.weight")
    skipped = mapper.map("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not skipped.loaded and "rotary" in skipped.skip_reason


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_halves_the_shards(model_dirs, family):
    full = {n: p.shape for n, p in replica(model_dirs, family, 0, 1).named_parameters()}
    for rank in (0, 1):
        half = {n: p.shape for n, p in replica(model_dirs, family, rank, 2).named_parameters()}
        assert set(half) == set(full)
        for name, shape in half.items():
            if name.endswith(("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                assert shape == (full[name][0] // 2, full[name][1]), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert shape == (full[name][0], full[name][1] // 2), name
            else:
                assert shape == full[name], name
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # 4 q heads + 2 kv heads of 16: q/k/v rows 64/32/32 -> 32/16/16 per rank.
    assert full[qkv][0] == 128 and half[qkv][0] == 64


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_load_weights_under_tp2_gives_each_rank_its_slice(model_dirs, family):
    sd = hf_state_dict(model_dirs, family)
    for rank in (0, 1):
        model = replica(model_dirs, family, rank, 2)
        model.load_weights(list(sd.items()))  # outside the context, as miles does
        params = dict(model.named_parameters())

        def rows(t):
            return t.chunk(2, dim=0)[rank]

        def cols(t):
            return t.chunk(2, dim=1)[rank]

        for layer in range(2):
            p = f"model.layers.{layer}"
            expect = {
                f"{p}.self_attn.qkv_proj.weight": torch.cat(
                    [rows(sd[f"{p}.self_attn.{x}_proj.weight"]) for x in "qkv"]
                ),
                f"{p}.mlp.gate_up_proj.weight": torch.cat(
                    [rows(sd[f"{p}.mlp.gate_proj.weight"]), rows(sd[f"{p}.mlp.up_proj.weight"])]
                ),
                f"{p}.self_attn.o_proj.weight": cols(sd[f"{p}.self_attn.o_proj.weight"]),
                f"{p}.mlp.down_proj.weight": cols(sd[f"{p}.mlp.down_proj.weight"]),
                f"{p}.input_layernorm.weight": sd[f"{p}.input_layernorm.weight"],
            }
            for name, want in expect.items():
                assert torch.equal(params[name].data, want), (family, rank, name)
        assert torch.equal(params["model.embed_tokens.weight"].data, rows(sd["model.embed_tokens.weight"]))
        assert torch.equal(params["lm_head.weight"].data, rows(sd["lm_head.weight"]))


def test_ep2_rank_maps_and_loads_only_its_own_experts(model_dirs):
    """EP 2, rank 1 holds experts 2 and 3; staged like miles until each param is complete."""
    model = replica(model_dirs, "qwen3_moe", 1, 2, moe_ep_size=2, moe_ep_rank=1, moe_tp_size=1)
    mapper = ParameterMapper.from_model(model)
    params = dict(model.named_parameters())
    sd = hf_state_dict(model_dirs, "qwen3_moe")

    m = mapper.map("model.layers.1.mlp.experts.3.up_proj.weight")
    assert (m.sglang_name, m.shard_id, m.num_shards, m.expert_id) == (
        "model.layers.1.mlp.experts.w13_weight", "w3", 2, 3,
    )
    assert (m.num_local_experts, m.num_experts_on_rank, m.num_tensors) == (4, 2, 8)
    m = mapper.map("model.layers.1.mlp.experts.0.down_proj.weight")
    assert (m.sglang_name, m.shard_id, m.num_shards) == ("model.layers.1.mlp.experts.w2_weight", "w2", 1)
    with pytest.raises(ParameterMappingError, match="expert 7"):
        mapper.map("model.layers.1.mlp.experts.7.down_proj.weight")

    # miles' _get_transfer_ready_params: hold each param until its tensors are in.
    staged, pending, flushed = {}, {}, []
    for name, tensor in sd.items():
        m = mapper.map(name)
        assert m.sglang_name in params, name
        expected = m.num_shards * (m.num_local_experts or 1)
        staged.setdefault(m.sglang_name, []).append((name, tensor))
        pending[m.sglang_name] = pending.get(m.sglang_name, expected) - 1
        if pending[m.sglang_name] == 0:
            model.load_weights(staged.pop(m.sglang_name))
            flushed.append(m.sglang_name)
            del pending[m.sglang_name]
    assert not staged and not pending and set(flushed) == set(params)

    w13 = params["model.layers.0.mlp.experts.w13_weight"].data
    w2 = params["model.layers.0.mlp.experts.w2_weight"].data
    assert w13.shape == (2, 64, 64) and w2.shape == (2, 64, 32)
    for local, expert in enumerate((2, 3)):
        p = f"model.layers.0.mlp.experts.{expert}"
        assert torch.equal(w13[local, :32], sd[f"{p}.gate_proj.weight"])
        assert torch.equal(w13[local, 32:], sd[f"{p}.up_proj.weight"])
        assert torch.equal(w2[local], sd[f"{p}.down_proj.weight"])


def test_pp2_last_stage_holds_its_layers_and_skips_the_rest(model_dirs):
    model = replica(model_dirs, "llama", 0, 1, pp_size=2, pp_rank=1)
    mapper = ParameterMapper.from_model(model)
    params = dict(model.named_parameters())
    loaded = {}
    for name in hf_state_dict(model_dirs, "llama"):
        m = mapper.map(name)
        if m.loaded:
            assert m.sglang_name in params, name
            loaded[m.sglang_name] = name
        else:
            assert "pipeline stage" in m.skip_reason, (name, m)
            assert "layers.0." in name or "embed_tokens" in name, name
    assert set(loaded) == set(params)
    assert "model.layers.1.self_attn.qkv_proj.weight" in params
    assert not any(n.startswith("model.layers.0.") for n in params)


def test_tied_lm_head_is_reported_as_skipped():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"tie_word_embeddings": True})()
            self.embed_tokens = torch.nn.Embedding(4, 2)

    m = ParameterMapper.from_model(Tied()).map("lm_head.weight")
    assert not m.loaded and "tie_word_embeddings" in m.skip_reason


# ---------------------------------------------------- ServerArgs.override


def test_override_before_resolution_sets_the_input_and_records_the_reason():
    from sglang.srt.arg_groups.server_args_override import override_log

    sa = ServerArgs(model_path="/nonexistent", nnodes=2, node_rank=1)
    assert sa.override("trainer.local_replica", nnodes=1, node_rank=0) is sa
    assert (sa.nnodes, sa.node_rank) == (1, 0)
    [rec] = override_log(sa)
    assert rec.reason == "trainer.local_replica"
    assert rec.fields == {"nnodes": 1, "node_rank": 0} and rec.stage == "input"

    with pytest.raises(ValueError, match="not ServerArgs fields"):
        sa.override("x", no_such_field=1)
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        sa.override("", nnodes=1)


def test_override_after_resolution_and_after_publication(model_dirs):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.arg_groups.server_args_override import override_log

    sa = engine_server_args(model_dirs["llama"])
    sa.resolve_once()
    sa.override("trainer.declared", max_running_requests=7)
    assert resolution_result(sa, "max_running_requests") == 7
    server_args_module.set_global_server_args_for_scheduler(sa)
    assert get_context().config_leaf("max_running_requests") == 7

    sa.override("trainer.live", max_running_requests=9)
    assert get_context().config_leaf("max_running_requests") == 9
    assert ("trainer.live", {"max_running_requests": 9}) in get_context().overrides_log()
    assert [(r.reason, r.stage) for r in override_log(sa)] == [
        ("trainer.declared", "declared"),
        ("trainer.live", "published"),
    ]


# ---------------------------------------------------- initialize_*(server_args)


def test_initialize_functions_accept_server_args(model_dirs):
    from sglang.srt.layers.quantization import fp4_utils, fp8_utils
    from sglang.srt.runtime_context import get_flags

    saved = snapshot_context()
    try:
        reset_context()
        sa = engine_server_args(model_dirs["llama"])
        # Nothing published: the record given is published, then read.
        initialize_moe_config(sa)
        assert get_context().server_args is sa
        assert get_flags().moe.runner_backend is not None
        initialize_fp8_gemm_config(sa)
        initialize_fp4_gemm_config(sa)
        assert fp8_utils.get_fp8_gemm_runner_backend() is not None
        assert fp4_utils.get_fp4_gemm_runner_backend() is not None
        # No argument: the published record, as the scheduler calls them.
        initialize_moe_config()
        initialize_fp8_gemm_config()
        initialize_fp4_gemm_config()
        # A different record is refused rather than silently republished.
        other = engine_server_args(model_dirs["llama"])
        for fn in (initialize_moe_config, initialize_fp8_gemm_config, initialize_fp4_gemm_config):
            with pytest.raises(ValueError, match="another ServerArgs is published"):
                fn(other)
    finally:
        restore_context(saved)
