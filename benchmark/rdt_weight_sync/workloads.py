"""What the benchmark's trainer sends: lists of ``(name, shape, dtype)``.

* ``uniform``: N equal tensors (``--uniform NxMiB``; 8 GiB as 256 x 32 MiB on a GPU);
* ``qwen3-4b``: the parameters of a Qwen3-4B-sized decoder in sglang's fused
  layout (``qkv_proj``, ``gate_up_proj``: what a rollout rank holds), 7.5 GiB;
* ``qwen3-4b-hf``: the same model under Hugging Face's names, q/k/v and
  gate/up unfused (what a trainer holds before any conversion);
* ``moe``: the routed experts of ``--moe-layers`` layers of Qwen3-30B-A3B
  (128 experts x gate/up/down, 3 MiB each in bf16: 3072 tensors, 9 GiB for
  8 layers) — what dominates an MoE model's update;
* ``many-small``: 12288 tensors of 0.75 MiB (9 GiB): what costs per tensor shows;
* ``mixed-moe``: a whole MoE model of ``--moe-layers`` layers of Qwen3-30B-A3B
  shapes: embeddings and lm_head (~600 MiB each), attention, norms (256 B),
  routers and experts: ~3.1k tensors from 256 B to 600 MiB;
* ``tiny``: a small decoder for CPU runs.

Shapes come from the models' configurations written out here (no download,
no transformers import).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

MiB, GiB = 2**20, 2**30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Spec = Tuple[str, Tuple[int, ...], torch.dtype]

QWEN3_4B = dict(vocab=151936, hidden=2560, inter=9728, layers=36, heads=32, kv_heads=8, head_dim=128)
TINY = dict(vocab=2048, hidden=128, inter=384, layers=4, heads=4, kv_heads=2, head_dim=32)
QWEN3_30B_A3B = dict(hidden=2048, moe_inter=768, experts=128, layers=48, vocab=151936, heads=32,
                     kv_heads=4, head_dim=128)


def uniform(n: int, mib: float, dtype: torch.dtype) -> List[Spec]:
    numel = int(mib * MiB) // torch.empty((), dtype=dtype).element_size()
    return [(f"layers.{i}.weight", (numel,), dtype) for i in range(n)]


def dense_decoder(cfg: Dict[str, int], dtype: torch.dtype, fused: bool) -> List[Spec]:
    """A Qwen3 decoder's parameters (tied embeddings: one embedding matrix)."""
    h, hd, inter = cfg["hidden"], cfg["head_dim"], cfg["inter"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    out: List[Spec] = [("model.embed_tokens.weight", (cfg["vocab"], h), dtype)]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}"
        attn = ([(f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h))] if fused else
                [(f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                 (f"{p}.self_attn.v_proj.weight", (kv, h))])
        mlp = ([(f"{p}.mlp.gate_up_proj.weight", (2 * inter, h))] if fused else
               [(f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h))])
        layer = [(f"{p}.input_layernorm.weight", (h,)), *attn,
                 (f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.self_attn.q_norm.weight", (hd,)),
                 (f"{p}.self_attn.k_norm.weight", (hd,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                 *mlp, (f"{p}.mlp.down_proj.weight", (h, inter))]
        out += [(n, s, dtype) for n, s in layer]
    out.append(("model.norm.weight", (h,), dtype))
    return out


def moe_experts(layers: int, dtype: torch.dtype, cfg: Dict[str, int] = QWEN3_30B_A3B) -> List[Spec]:
    """The routed experts of ``layers`` MoE layers, per expert gate/up/down."""
    h, mi = cfg["hidden"], cfg["moe_inter"]
    out: List[Spec] = []
    for i in range(layers):
        for e in range(cfg["experts"]):
            p = f"model.layers.{i}.mlp.experts.{e}"
            out += [(f"{p}.gate_proj.weight", (mi, h), dtype), (f"{p}.up_proj.weight", (mi, h), dtype),
                    (f"{p}.down_proj.weight", (h, mi), dtype)]
    return out


def mixed_moe(layers: int, dtype: torch.dtype, cfg: Dict[str, int] = QWEN3_30B_A3B) -> List[Spec]:
    """A whole MoE model (untied embeddings): every kind and size of tensor a trainer sends."""
    h, hd = cfg["hidden"], cfg["head_dim"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    experts = moe_experts(layers, dtype, cfg)
    out: List[Spec] = [("model.embed_tokens.weight", (cfg["vocab"], h), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(n, s, dtype) for n, s in (
            (f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)), (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)), (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate.weight", (cfg["experts"], h)))]
        out += [e for e in experts if e[0].startswith(f"{p}.")]
    out += [("model.norm.weight", (h,), dtype), ("lm_head.weight", (cfg["vocab"], h), dtype)]
    return out


def lora_adapter(cfg: Dict[str, int], r: int, dtype: torch.dtype, name: str = "rl") -> List[Spec]:
    """A rank-``r`` LoRA adapter of every attention and MLP projection of every
    layer, as PEFT saves it: ``{name}:base_model.model...lora_{A,B}.weight``."""
    h, hd, inter = cfg["hidden"], cfg["head_dim"], cfg["inter"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    out: List[Spec] = []
    for i in range(cfg["layers"]):
        for mod, n_in, n_out in (("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                                 ("self_attn.o_proj", q, h), ("mlp.gate_proj", h, inter), ("mlp.up_proj", h, inter),
                                 ("mlp.down_proj", inter, h)):
            p = f"{name}:base_model.model.model.layers.{i}.{mod}"
            out += [(f"{p}.lora_A.weight", (r, n_in), dtype), (f"{p}.lora_B.weight", (n_out, r), dtype)]
    return out


def workload(name: str, args) -> Tuple[List[Spec], Dict[str, Any]]:
    """The specs of workload ``name`` and a description of it."""
    dtype = DTYPES[args.dtype]
    if name == "uniform":
        n, mib = args.uniform.lower().split("x")
        specs = uniform(int(n), float(mib), dtype)
    elif name in ("qwen3-4b", "qwen3-4b-hf"):
        specs = dense_decoder(QWEN3_4B, dtype, fused=name == "qwen3-4b")
    elif name == "moe":
        specs = moe_experts(args.moe_layers, dtype)
    elif name == "many-small":
        specs = uniform(12288, 0.75, dtype)
    elif name == "mixed-moe":
        specs = mixed_moe(args.moe_layers, dtype)
    elif name == "tiny":
        specs = dense_decoder(TINY, dtype, fused=True)
    else:
        raise SystemExit(f"unknown workload {name!r} (uniform, qwen3-4b, qwen3-4b-hf, moe, many-small, "
                         "mixed-moe, tiny)")
    nbytes = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in specs)
    sizes = sorted(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in specs)
    return specs, {"tensors": len(specs), "bytes": nbytes, "dtype": args.dtype,
                   "median_tensor_bytes": sizes[len(sizes) // 2], "largest_tensor_bytes": sizes[-1]}
