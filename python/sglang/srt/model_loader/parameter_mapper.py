"""Which sglang parameter a Hugging Face checkpoint tensor lands in.

sglang fuses some checkpoint tensors into one parameter: ``q_proj``/``k_proj``/
``v_proj`` into ``qkv_proj`` (shard ids ``"q"``/``"k"``/``"v"``),
``gate_proj``/``up_proj`` into ``gate_up_proj`` (shard ids ``0``/``1``), and the
per-expert ``experts.{e}.gate_proj/up_proj/down_proj`` of a MoE layer into
``experts.w13_weight`` (shards ``"w1"``/``"w3"``) and ``experts.w2_weight``
(shard ``"w2"``). A trainer that streams checkpoint tensors into a model
replica has to know, for each tensor, which parameter it fills and how many
tensors complete that parameter, so it can hold a fused parameter back until
all of its parts have arrived and then call ``model.load_weights`` once::

    mapper = ParameterMapper.from_model(model)
    m = mapper.map("model.layers.0.self_attn.k_proj.weight")
    m.sglang_name        # "model.layers.0.self_attn.qkv_proj.weight"
    m.shard_id           # "k"
    m.num_shards         # 3
    m.num_local_experts  # None (not an expert tensor)

The fusion rules come from the model itself -- its ``stacked_params_mapping``
attribute, ``packed_modules_mapping`` and ``bitsandbytes_stacked_params_mapping``
class tables -- plus the qkv/gate_up convention every sglang model's
``load_weights`` uses, and the MoE layers found in the model. A rule is used
only when the parameter it names exists in the model, so each answer is a name
of ``dict(model.named_parameters())``, or the mapping says why the tensor is not
loaded by this model (``skip_reason``: tied ``lm_head``, a rotary cache, a layer
of another pipeline stage). Anything else raises :class:`ParameterMappingError`
naming the checkpoint tensor.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["ParameterMapper", "ParameterMapping", "ParameterMappingError"]

ShardId = Union[int, str]

# The convention of every sglang decoder's load_weights: (fused, part, shard id).
_DEFAULT_STACKED: Tuple[Tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_QKV_SHARD_IDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}

# Per-expert checkpoint projections -> (FusedMoE parameter prefix, shard id).
_EXPERT_PROJ = {
    "gate_proj": ("w13_", "w1"),
    "w1": ("w13_", "w1"),
    "up_proj": ("w13_", "w3"),
    "w3": ("w13_", "w3"),
    "down_proj": ("w2_", "w2"),
    "w2": ("w2_", "w2"),
}
_EXPERT_SHARDS = {"w13_": 2, "w2_": 1}
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.*\bexperts)\.(?P<eid>\d+)\.(?P<proj>[^.]+)\.(?P<suffix>.+)$")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROTARY_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class ParameterMappingError(KeyError):
    """No parameter of the model takes this checkpoint tensor."""

    def __init__(self, hf_name: str, message: str):
        super().__init__(hf_name)
        self.hf_name = hf_name
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ParameterMapping:
    """Where one checkpoint tensor goes.

    ``sglang_name``: the parameter of ``model.named_parameters()`` it fills
    (for a skipped tensor, the name it would have).
    ``shard_id``: what ``load_weights`` passes to that parameter's
    ``weight_loader`` for it (``"q"``/``"k"``/``"v"``, ``0``/``1``,
    ``"w1"``/``"w3"``/``"w2"``), ``None`` for an unfused parameter.
    ``num_shards``: how many distinct checkpoint tensors (per expert, for an
    expert parameter) make up the parameter: 3 for ``qkv_proj``, 2 for
    ``gate_up_proj`` and ``w13_weight``, 1 otherwise.
    ``expert_id``: the checkpoint's expert index, for a per-expert tensor.
    ``num_local_experts``: for an expert parameter, how many experts' tensors
    ``load_weights`` routes into it -- every expert of the checkpoint, as each
    rank's loader reads all of them and keeps those its EP slot owns -- so the
    parameter is complete after ``num_local_experts * num_shards`` tensors;
    ``None`` for other parameters. ``num_experts_on_rank`` is how many experts
    the parameter itself holds on this rank (its first dimension).
    ``skip_reason``: set when the model does not load this tensor at all.
    """

    hf_name: str
    sglang_name: str
    shard_id: Optional[ShardId] = None
    num_shards: int = 1
    expert_id: Optional[int] = None
    num_local_experts: Optional[int] = None
    num_experts_on_rank: Optional[int] = None
    skip_reason: Optional[str] = None

    @property
    def loaded(self) -> bool:
        return self.skip_reason is None

    @property
    def num_tensors(self) -> int:
        """Checkpoint tensors that complete ``sglang_name``."""
        return self.num_shards * (self.num_local_experts or 1)


@dataclass(frozen=True)
class _ExpertLayer:
    num_experts: int
    num_on_rank: Optional[int]


class ParameterMapper:
    """Maps checkpoint tensor names to a model's parameters (see the module doc)."""

    def __init__(
        self,
        param_names: Iterable[str],
        stacked: Sequence[Tuple[str, str, ShardId]] = _DEFAULT_STACKED,
        expert_layers: Optional[Dict[str, _ExpertLayer]] = None,
        *,
        model_name: str = "model",
        tied_names: Iterable[str] = (),
        layer_range: Optional[Tuple[int, int]] = None,
        absent_modules: Iterable[str] = (),
    ):
        self.model_name = model_name
        self.param_names = frozenset(param_names)
        self._stacked: Dict[str, Tuple[str, ShardId]] = {}
        for fused, part, shard_id in stacked:
            self._stacked.setdefault(part, (fused, shard_id))
        self._num_shards: Dict[str, int] = {}
        for fused, _ in self._stacked.values():
            self._num_shards[fused] = self._num_shards.get(fused, 0) + 1
        self._experts = dict(expert_layers or {})
        self._tied = frozenset(tied_names)
        self._layer_range = layer_range
        self._absent = tuple(absent_modules)
        self._cache: Dict[str, ParameterMapping] = {}

    # ----------------------------------------------------------- construction

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "ParameterMapper":
        """Read the fusion rules, MoE layers, ties and pipeline range of ``model``."""
        param_names = [name for name, _ in model.named_parameters()]
        components = {c for name in param_names for c in name.split(".")}

        candidates: List[Tuple[str, str, ShardId]] = []
        for entry in getattr(model, "stacked_params_mapping", None) or ():
            if len(entry) >= 3:
                candidates.append((entry[0], entry[1], entry[2]))
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            for index, part in enumerate(parts):
                candidates.append((fused, part, _QKV_SHARD_IDS.get(_bare(part), index)))
        bnb = getattr(model, "bitsandbytes_stacked_params_mapping", None) or {}
        for part, (fused, index) in bnb.items():
            shard = _QKV_SHARD_IDS.get(_bare(part), index) if _bare(fused).endswith("qkv_proj") else index
            candidates.append((fused, part, shard))
        candidates.extend(_DEFAULT_STACKED)

        stacked = []
        seen = set()
        for fused, part, shard_id in candidates:
            fused, part = _bare(fused), _bare(part)
            # Dotted entries ("mlp.gate_up_proj") are not single name components.
            if "." in fused or "." in part or fused not in components:
                continue
            if part in seen:
                continue
            seen.add(part)
            stacked.append((fused, part, shard_id))

        experts: Dict[str, _ExpertLayer] = {}
        absent: List[str] = []
        for module_name, module in model.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if any(n.startswith(("w13_", "w2_")) for n in own):
                num_experts = getattr(module, "num_experts", None)
                if num_experts is not None:
                    experts[module_name] = _ExpertLayer(
                        int(num_experts), getattr(module, "num_local_experts", None)
                    )
            if type(module).__name__ == "PPMissingLayer" and module_name:
                absent.append(module_name)

        config = getattr(model, "config", None)
        tied = ()
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in param_names:
            tied = ("lm_head.weight",)

        layer_range = None
        for holder in (model, getattr(model, "model", None)):
            start = getattr(holder, "start_layer", None)
            end = getattr(holder, "end_layer", None)
            if isinstance(start, int) and isinstance(end, int):
                layer_range = (start, end)
                break

        return cls(
            param_names,
            stacked,
            experts,
            model_name=type(model).__name__,
            tied_names=tied,
            layer_range=layer_range,
            absent_modules=absent,
        )

    # ---------------------------------------------------------------- mapping

    def map(self, hf_name: str) -> ParameterMapping:
        """Where ``hf_name`` goes; raises :class:`ParameterMappingError` if nowhere."""
        found = self._cache.get(hf_name)
        if found is None:
            found = self._map(hf_name)
            self._cache[hf_name] = found
        return found

    __call__ = map

    def _param(self, name: str) -> Optional[str]:
        """``name`` or its ``model.``-prefixed form, whichever is a parameter."""
        if name in self.param_names:
            return name
        if not name.startswith("model.") and f"model.{name}" in self.param_names:
            return f"model.{name}"
        return None

    def _map(self, hf_name: str) -> ParameterMapping:
        name = self._param(hf_name)
        if name is not None:
            return ParameterMapping(hf_name, name)

        expert = self._map_expert(hf_name)
        if expert is not None:
            return expert

        parts = hf_name.split(".")
        for i, part in enumerate(parts):
            rule = self._stacked.get(part)
            if rule is None:
                continue
            fused, shard_id = rule
            name = self._param(".".join(parts[:i] + [fused] + parts[i + 1 :]))
            if name is not None:
                return ParameterMapping(
                    hf_name, name, shard_id=shard_id, num_shards=self._num_shards[fused]
                )

        reason = self._skip_reason(hf_name)
        if reason is not None:
            return ParameterMapping(hf_name, self._fused_name(hf_name), skip_reason=reason)

        close = difflib.get_close_matches(
            self._fused_name(hf_name), sorted(self.param_names), n=3, cutoff=0.6
        )
        hint = f"; closest parameters: {close}" if close else ""
        raise ParameterMappingError(
            hf_name,
            f"ParameterMapper({self.model_name}): no parameter takes the checkpoint "
            f"tensor {hf_name!r} -- it is neither a parameter name, a part of a "
            f"fused parameter ({', '.join(sorted(set(self._num_shards)))}), nor an "
            f"expert tensor of a MoE layer{hint}",
        )

    def _map_expert(self, hf_name: str) -> Optional[ParameterMapping]:
        m = _PER_EXPERT_RE.match(hf_name)
        if m is not None and m.group("proj") in _EXPERT_PROJ:
            base, shard_id = _EXPERT_PROJ[m.group("proj")]
            layer_name, layer = self._expert_layer(m.group("prefix"))
            if layer is not None:
                name = self._param(f"{layer_name}.{base}{m.group('suffix')}")
                if name is not None:
                    expert_id = int(m.group("eid"))
                    if expert_id >= layer.num_experts:
                        raise ParameterMappingError(
                            hf_name,
                            f"ParameterMapper({self.model_name}): {hf_name!r} names "
                            f"expert {expert_id}, but {layer_name} has "
                            f"{layer.num_experts} experts",
                        )
                    return ParameterMapping(
                        hf_name,
                        name,
                        shard_id=shard_id,
                        num_shards=_EXPERT_SHARDS[base],
                        expert_id=expert_id,
                        num_local_experts=layer.num_experts,
                        num_experts_on_rank=layer.num_on_rank,
                    )
        return None

    def _expert_layer(self, prefix: str):
        for candidate in (prefix, f"model.{prefix}"):
            layer = self._experts.get(candidate)
            if layer is not None:
                return candidate, layer
        return prefix, None

    def _fused_name(self, hf_name: str) -> str:
        parts = [self._stacked.get(p, (p, None))[0] for p in hf_name.split(".")]
        return ".".join(parts)

    def _skip_reason(self, hf_name: str) -> Optional[str]:
        if hf_name in self._tied:
            return "tied to the input embedding (tie_word_embeddings); load_weights skips it"
        if any(cache in hf_name for cache in _ROTARY_CACHES):
            return "a rotary-embedding cache sglang computes itself; load_weights skips it"
        m = _LAYER_RE.search(hf_name)
        if m is not None and self._layer_range is not None:
            layer = int(m.group(1))
            start, end = self._layer_range
            if not start <= layer < end:
                return (
                    f"layer {layer} is on another pipeline stage (this rank holds "
                    f"layers [{start}, {end}))"
                )
        for module_name in self._absent:
            for name in (hf_name, f"model.{hf_name}"):
                if name.startswith(module_name + "."):
                    return f"{module_name} is on another pipeline stage"
        return None

    def __repr__(self) -> str:
        fused = ", ".join(f"{k}x{v}" for k, v in sorted(self._num_shards.items()))
        return (
            f"ParameterMapper({self.model_name}: {len(self.param_names)} parameters, "
            f"fused [{fused}], {len(self._experts)} MoE layers)"
        )


def _bare(name: str) -> str:
    return name.strip(".")
