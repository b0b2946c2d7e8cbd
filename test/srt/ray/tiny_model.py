"""A tiny random-weight Llama and a locally trained tokenizer (nothing downloaded).

``build_tiny_model(path)`` writes a Hugging Face model directory that sglang can
serve on CPU; ``hf_greedy(path, prompt, n)`` is the reference greedy decode from
transformers for the same weights; ``random_state_dict(path, seed)`` gives a
*different* set of weights of the same layout (what a trainer would push).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a trainer pushes new weights to the rollout engine after each step",
    "ray direct transport moves tensors between actors without copies",
    "sglang serves language models with a radix cache and a scheduler",
    "weights land in the live parameters of the model on every rank",
    "hello world, numbers 0 1 2 3 4 5 6 7 8 9 and punctuation . , ; : ! ?",
] * 20

# Large enough init that greedy argmax is not decided by float noise.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(str(path))
    return fast


# Other families for native-model tests: the same sizes, their own quirks
# (Qwen3: q/k norms; Qwen3-MoE: 4 experts of width 32, top-2, every layer).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "norm_topk_prob": True},
    ),
}


def tiny_config(family: str = "llama", **more):
    """The ``transformers`` config of a tiny ``family`` model (see FAMILIES),
    float32, with ``more`` on top."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**CONFIG, **extra, "torch_dtype": "float32", **more})
    config.architectures = [model_cls]
    return config


def build_tiny_model(path, seed: int = 0, family: str = "llama") -> Path:
    """A random ``family`` model (see FAMILIES) + tokenizer at ``path``."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config = tiny_config(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def checkpoint_state_dict(path) -> Dict[str, torch.Tensor]:
    """The tensors of the checkpoint at ``path`` under their stored (HF) names."""
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_hf(path, state_dict: Dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected, unexpected
    return model.eval()


@torch.no_grad()
def hf_greedy(path, prompt: str, max_new_tokens: int, state_dict=None) -> List[int]:
    """Greedy continuation token ids from transformers, one token at a time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = load_hf(path, state_dict)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def random_state_dict(path, seed: int) -> Dict[str, torch.Tensor]:
    """New random weights with the layout of the model at ``path``."""
    model = load_hf(path)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            out[name] = 0.3 * torch.randn(p.shape, generator=gen)
    return out
