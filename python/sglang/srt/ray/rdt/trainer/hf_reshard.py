"""Turn a Hugging Face state dict into each engine rank's parameters, with sglang's own loaders.

Per distinct rank layout, a dummy-loaded replica of the rollout model loads the HF tensors with its own
``load_weights``; its parameters (valid until the next :meth:`HFResharder.reshard`) are what the rank holds.
Nothing model-specific lives here; a state dict is checked whole before a byte moves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from sglang.srt.ray.rdt.errors import WeightSyncError, close_names, dtype_name
from sglang.srt.ray.rdt.trainer.buckets import group_ranks

logger = logging.getLogger(__name__)

__all__ = ["HFResharder", "HFTensorSpec", "checkpoint_layout", "layout_key"]

# ServerArgs fields (from /server_info) that decide a rank's parameter layout; the rest keep their defaults.
LAYOUT_SERVER_ARGS = ("dtype", "quantization", "trust_remote_code", "revision", "tp_size", "pp_size",
                      "ep_size", "json_model_override_args")

# Fields of /parallelism_config that do not change which slice a rank holds.
_NOT_LAYOUT = ("dp_rank", "dp_size", "node_rank", "nnodes", "world_rank", "world_size")

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class HFTensorSpec:
    """One checkpoint tensor: its shape and stored dtype."""

    shape: Tuple[int, ...]
    dtype: torch.dtype


def checkpoint_layout(model_path: Union[str, Path]) -> Dict[str, HFTensorSpec]:
    """``{hf_name: HFTensorSpec}`` of a checkpoint, from its safetensors headers or else its meta-device model."""
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if files:
        out: Dict[str, HFTensorSpec] = {}
        for f in files:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise WeightSyncError(f"{f.name}: tensor {name!r} has dtype {meta['dtype']!r}, "
                                          "which HF-format updates do not handle")
                out[name] = HFTensorSpec(tuple(int(d) for d in meta["shape"]), dtype)
        return out
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(root))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise WeightSyncError(f"cannot tell the Hugging Face layout of {str(root)!r} (no *.safetensors, and "
                              f"transformers could not build it: {e}); pass model_path= a checkpoint directory of "
                              "the rollout model") from e
    return {name: HFTensorSpec(tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def layout_key(config) -> Tuple[Tuple[str, int], ...]:
    """What decides a rank's slice: ranks with equal keys hold equal tensors."""
    lay = config.layout()
    return tuple(sorted((k, v) for k, v in lay.items() if k not in _NOT_LAYOUT))


@contextlib.contextmanager
def _published(server_args):
    """Publish ``server_args`` (as the scheduler would) and put back what was there."""
    from sglang.srt import server_args as server_args_module
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.runtime_context import restore_context, snapshot_context

    saved = snapshot_context()
    try:
        server_args_module.set_global_server_args_for_scheduler(server_args)
        initialize_moe_config(server_args)
        initialize_fp8_gemm_config(server_args)
        initialize_fp4_gemm_config(server_args)
        yield
    finally:
        restore_context(saved)


class _Replica:
    """One rank layout: a dummy-loaded model, its mapper and its parameters."""

    def __init__(self, config, server_args, model_path: str, device: str):
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed.parallel_state import ParallelismContext
        from sglang.srt.model_loader import get_model
        from sglang.srt.model_loader.parameter_mapper import ParameterMapper

        self.config, self.server_args = config, server_args
        with _published(server_args), ParallelismContext(config):
            self.model = get_model(
                model_config=ModelConfig(model_path, dtype=server_args.dtype,
                                         trust_remote_code=server_args.trust_remote_code),
                load_config=LoadConfig(load_format="dummy", model_loader_extra_config=None),
                device_config=DeviceConfig(device=device))
        self.mapper = ParameterMapper.from_model(self.model)
        self.params = dict(self.model.named_parameters())
        self.parts: Dict[str, List[str]] = {}  # sglang name -> the HF names that fill it (from the checkpoint layout)

    def load(self, items: List[Tuple[str, torch.Tensor]]) -> None:
        with _published(self.server_args), torch.no_grad():
            self.model.load_weights(items)


class HFResharder:
    """Per-rank sglang tensors from one HF state dict, for one engine's layout.

    Args:
        model_path: the rollout model's checkpoint directory on this host.
        server_args: the engine's ``ServerArgs`` or ``/server_info`` dict (only :data:`LAYOUT_SERVER_ARGS` are read).
        rank_configs: each rank's ``RankParallelismConfig`` (or its JSON), in global rank order.
        device: where the replicas live (default ``"cpu"``; ``"cuda"`` is faster for large models).
    """

    def __init__(self, model_path: Union[str, Path], server_args: Union[Mapping[str, Any], Any],
                 rank_configs: Sequence[Union[Mapping[str, Any], Any]], *, device: str = "cpu"):
        from sglang.srt.distributed.parallel_state import RankParallelismConfig

        if not rank_configs:
            raise WeightSyncError("HFResharder needs the parallelism config of at least one rank")
        self.model_path = str(model_path)
        self.device = device
        self.server_args = _replica_server_args(self.model_path, server_args, device)
        self.rank_configs = [c if isinstance(c, RankParallelismConfig) else RankParallelismConfig.from_dict(c)
                             for c in rank_configs]
        self.keys = [layout_key(c) for c in self.rank_configs]
        self._replicas: Dict[Tuple, _Replica] = {}
        self._hf: Optional[Dict[str, HFTensorSpec]] = None

    @classmethod
    def from_engine_url(cls, url: str, num_ranks: int, *, model_path: Optional[Union[str, Path]] = None,
                        timeout_s: float = 60.0, api_key: Optional[str] = None, **kwargs) -> "HFResharder":
        """Build from the engine's ``/server_info`` and ``/parallelism_config`` (default: its ``--model-path``)."""
        from sglang.srt.ray.rdt.trainer.discovery import http

        url = url.rstrip("/")
        info = http("GET", url, "/server_info", api_key, timeout_s)
        configs = [http("GET", url, f"/parallelism_config?rank={r}", api_key, timeout_s) for r in range(num_ranks)]
        return cls(model_path or info["model_path"], info, configs, **kwargs)

    @property
    def hf_layout(self) -> Dict[str, HFTensorSpec]:
        if self._hf is None:
            self._hf = checkpoint_layout(self.model_path)
        return self._hf

    def replica(self, key: Tuple) -> _Replica:
        """The replica of one layout (built on first use)."""
        if key not in self._replicas:
            config = self.rank_configs[self.keys.index(key)]
            replica = _Replica(config, self.server_args, self.model_path, self.device)
            for hf_name in self.hf_layout:
                m = replica.mapper.map(hf_name)
                if m.loaded:
                    replica.parts.setdefault(m.sglang_name, []).append(hf_name)
            logger.info("[RDT] HF reshard: replica of %s built (%d parameters)", config.describe(), len(replica.params))
            self._replicas[key] = replica
        return self._replicas[key]

    def rank_groups(self) -> List[List[int]]:
        """Ranks that hold equal tensors, in first-rank order."""
        return group_ranks(self.keys)

    def check(self, hf_state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> None:
        """Raise :class:`WeightSyncError`, naming the tensor, unless the state dict fits the checkpoint (every
        part of a fused parameter given; with ``strict``, every tensor)."""
        from sglang.srt.model_loader.parameter_mapper import ParameterMappingError

        if not hf_state_dict:
            raise WeightSyncError("empty update: no tensors were given")
        expected = self.hf_layout
        dtype = self.server_args.dtype  # the engine's --dtype, or "auto"
        engine_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        for name, t in hf_state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise WeightSyncError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
            spec = expected.get(name)
            if spec is None:
                raise WeightSyncError(f"{name!r} is not a tensor of the checkpoint at {self.model_path!r} "
                                      f"({close_names(name, expected)}); HF-format updates take the checkpoint's names")
            if tuple(t.shape) != spec.shape:
                raise WeightSyncError(f"{name!r}: shape {tuple(t.shape)} does not match the checkpoint's "
                                      f"{spec.shape} (HF-format updates take full, unsharded tensors)")
            allowed = {d for d in (spec.dtype, engine_dtype) if d is not None}
            if t.dtype not in allowed:
                raise WeightSyncError(f"{name!r}: dtype {dtype_name(t.dtype)}; expected "
                                      + " or ".join(sorted(dtype_name(d) for d in allowed))
                                      + " (the checkpoint's or the engine's --dtype)")
        for key in dict.fromkeys(self.keys):
            replica = self.replica(key)
            for name in hf_state_dict:
                try:
                    replica.mapper.map(name)
                except ParameterMappingError as e:
                    raise WeightSyncError(f"{name!r}: {e}") from None
            for sglang_name, parts in replica.parts.items():
                given = [p for p in parts if p in hf_state_dict]
                if given and len(given) != len(parts) or strict and not given:
                    missing = [p for p in parts if p not in hf_state_dict]
                    raise WeightSyncError(f"parameter {sglang_name!r} of {replica.config.describe()} is built from "
                                          f"{len(parts)} checkpoint tensors; missing: {missing[:8]}"
                                          + ("" if given else " (strict=True requires every parameter)"))

    def reshard(self, hf_state_dict: Mapping[str, torch.Tensor], *,
                strict: bool = False) -> Dict[int, Dict[str, torch.Tensor]]:
        """``{rank: {sglang_name: tensor}}``, one mapping per layout; raises as :meth:`check` (nothing loaded)."""
        hf_state_dict = dict(hf_state_dict)
        self.check(hf_state_dict, strict=strict)
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for group in self.rank_groups():
            replica = self.replica(self.keys[group[0]])
            names = [n for n, parts in replica.parts.items() if parts[0] in hf_state_dict]
            items = [(p, hf_state_dict[p].detach()) for n in names for p in replica.parts[n]]
            replica.load(items)
            tensors = {n: replica.params[n].data for n in names}
            out.update(dict.fromkeys(group, tensors))  # (the ranks of one layout share its tensors)
        return out


def _replica_server_args(model_path: str, server_args, device: str):
    from sglang.srt.server_args import ServerArgs

    if not isinstance(server_args, Mapping):
        server_args = {k: getattr(server_args, k) for k in LAYOUT_SERVER_ARGS}
    fields = {k: server_args[k] for k in LAYOUT_SERVER_ARGS if server_args.get(k) is not None}
    return ServerArgs(model_path=model_path, device=device, skip_tokenizer_init=True, **fields)
