"""LoRA adapters pushed as tensors by a weight update: a stash per adapter, committed at the end.

An adapter registered for weight sync (``register_lora_adapter(lora_name,
config_dict)``) gets a *stash* on every rank: one contiguous tensor per key of
the adapter as PEFT saves it (``base_model.model.<module>.lora_A.weight``,
unsharded), carved from one buffer. A weight update writes them like any
parameter, under ``"{lora_name}:{PEFT key}"`` (checked by name, shape and
dtype before any byte lands). When the update ends, each adapter it wrote is
*committed*: the stash's bytes are copied once on the device, and sglang's
LoRA manager takes that copy in place (``upsert_lora_adapter_from_tensors``
with ``keep_device``: the same id and memory-pool slot, no host copy; each
rank keeps its tensor-parallel shard, as a load from disk does). The copy is
never written again: a dropped update copies it back into the stash, so the
next update starts from what is served.

No Ray here: the rank core (``sglang/srt/ray/rdt/engine``) owns the
:class:`AdapterStashes` of a rank and reaches sglang's LoRA manager through
its scheduler port.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

# "{lora_name}:{PEFT key}": an adapter's tensor in a weight update.
SEP = ":"
PREFIX = "base_model.model."
# Fused sglang modules and the PEFT modules they stack (in the stacking order).
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def split_name(name: str) -> Optional[Tuple[str, str]]:
    """``(lora_name, PEFT key)`` of an adapter tensor's name, or None for a model parameter."""
    lora, sep, key = name.partition(SEP)
    return (lora, key) if sep and key.startswith(PREFIX) else None


def expected_tensors(lora_modules: List[Dict[str, Any]], target_modules: Iterable[str] | str,
                     r: int) -> Dict[str, Tuple[int, ...]]:
    """The PEFT keys and unsharded shapes of a rank-``r`` adapter of
    ``target_modules`` over the LoRA-wrapped layers ``lora_modules`` (sglang's
    ``LoRAManager.lora_modules``: per layer, ``{module path: wrapped layer}``)."""
    targets = {"all"} if isinstance(target_modules, str) else {t.split(".")[-1] for t in target_modules}
    out: Dict[str, Tuple[int, ...]] = {}
    for layer in lora_modules:
        for path, module in layer.items():
            prefix, leaf = path.rsplit(".", 1)
            for sub, n_in, n_out in _parts(leaf, module.base_layer):
                if "all" in targets or sub in targets:
                    key = f"{PREFIX}{prefix}.{sub}"
                    out[f"{key}.lora_A.weight"] = (r, n_in)
                    out[f"{key}.lora_B.weight"] = (n_out, r)
    return out


def _parts(leaf: str, base) -> List[Tuple[str, int, int]]:
    """``(PEFT module, in features, out features)`` of a wrapped layer, unsharded."""
    if leaf == "qkv_proj":
        q, kv = base.total_num_heads * base.head_size, base.total_num_kv_heads * base.head_size
        return [("q_proj", base.input_size, q), ("k_proj", base.input_size, kv),
                ("v_proj", base.input_size, base.total_num_kv_heads * base.v_head_size)]
    if leaf in STACKED:
        return [(sub, base.input_size, size) for sub, size in zip(STACKED[leaf], base.output_sizes)]
    return [(leaf, base.input_size, base.output_size)]


def checksum(tensors: Dict[str, torch.Tensor]) -> str:
    """sha256 of an adapter's bytes, key by key in sorted order: what a trainer
    computes of what it sent to compare with the engine's."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _carve(flat: torch.Tensor, layout: Dict[str, Tuple[int, ...]]) -> Dict[str, torch.Tensor]:
    """``layout``'s tensors as consecutive views of ``flat``."""
    out, at = {}, 0
    for key, shape in layout.items():
        n = torch.Size(shape).numel()
        out[key] = flat[at:at + n].view(shape)
        at += n
    return out


@dataclass
class AdapterStash:
    """One registered adapter on one rank: ``flat`` (what updates write, viewed as ``tensors``) and a copy of what
    is served on the same device (``served``, viewed as ``committed``: what sglang serves from and a dropped update
    restores; never written); its checksum is computed when asked, once per commit (hashing on the host is far
    slower than the update itself)."""

    name: str
    lora_id: str
    config: Dict[str, Any]
    flat: torch.Tensor
    tensors: Dict[str, torch.Tensor]  # PEFT key -> its view of ``flat``
    served: Optional[torch.Tensor] = None  # a copy of ``flat`` as last committed
    version: int = 0  # commits so far
    weight_version: Optional[str] = None
    _published: Tuple[int, Optional[torch.Tensor]] = (0, None)  # (commits, their copy): what a checksum is of
    _checksum: Tuple[int, str] = (-1, "")

    def commit(self, apply: Optional[Callable[["AdapterStash"], None]] = None) -> None:
        """Serve what ``flat`` holds: a new copy, handed to ``apply`` (as ``committed``) before it counts; a
        refusal leaves the last copy served."""
        last, self.served = self.served, self.flat.clone()
        try:
            if apply is not None:
                apply(self)
        except BaseException:
            self.served = last
            raise
        self._published = (self._published[0] + 1, self.served)  # (one assignment: status reads it anytime)

    @property
    def committed(self) -> Dict[str, torch.Tensor]:
        return _carve(self.served, {k: tuple(t.shape) for k, t in self.tensors.items()})

    @property
    def checksum(self) -> str:
        n, served = self._published  # (never a copy being committed: a commit may run meanwhile on the scheduler)
        if self._checksum[0] != n:
            self._checksum = (n, checksum(_carve(served, {k: tuple(t.shape) for k, t in self.tensors.items()})))
        return self._checksum[1]

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def status(self) -> Dict[str, Any]:
        return {"lora_id": self.lora_id, "version": self.version, "weight_version": self.weight_version,
                "r": self.config.get("r"), "lora_alpha": self.config.get("lora_alpha"),
                "tensors": len(self.tensors), "bytes": self.nbytes, "checksum": self.checksum}


class AdapterStashes:
    """The stashes of one rank, by adapter name (the rank's scheduler thread
    changes them; status is read from others)."""

    def __init__(self):
        self.stashes: Dict[str, AdapterStash] = {}

    def register(self, name: str, lora_id: str, config: Dict[str, Any], layout: Dict[str, Tuple[int, ...]],
                 dtype: torch.dtype, device) -> Tuple[AdapterStash, str]:
        """The stash of adapter ``name`` (zeroed when new or when its config
        changed) and what happened: ``created``, ``unchanged`` or ``reconfigured``."""
        old = self.stashes.get(name)
        same = old is not None and old.config == config and {k: tuple(t.shape) for k, t in old.tensors.items()} \
            == layout and next(iter(old.tensors.values())).dtype == dtype
        if same:
            return old, "unchanged"
        flat = torch.zeros(sum(torch.Size(s).numel() for s in layout.values()), dtype=dtype, device=device)
        stash = AdapterStash(name, old.lora_id if old else lora_id, dict(config), flat, _carve(flat, layout))
        stash.commit()
        self.stashes[name] = stash
        return stash, "created" if old is None else "reconfigured"

    def put_back(self, name: str, stash: Optional[AdapterStash]) -> None:
        """Undo a :meth:`register` that sglang refused: ``stash`` (None: no adapter) is ``name``'s again."""
        if stash is None:
            self.stashes.pop(name, None)
        else:
            self.stashes[name] = stash

    def named_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, stash in list(self.stashes.items()):  # (a register may run meanwhile on the scheduler)
            for key, t in stash.tensors.items():
                yield f"{name}{SEP}{key}", t

    def written(self, names: Iterable[str]) -> List[str]:
        """The adapters that ``names`` (written parameters) wrote in."""
        out = {s[0] for s in map(split_name, names) if s is not None}
        return [n for n in self.stashes if n in out]

    def commit(self, names: Iterable[str], apply: Callable[[AdapterStash], None],
               weight_version: Optional[str]) -> Dict[str, int]:
        """Have sglang serve every adapter ``names`` wrote in (``apply(stash)``);
        returns the bytes each moved."""
        moved = {}
        for name in self.written(names):
            stash = self.stashes[name]
            stash.commit(apply)
            stash.version += 1
            stash.weight_version = weight_version
            moved[name] = stash.nbytes
        return moved

    def restore(self, names: Iterable[str]) -> None:
        """An update dropped: the adapters it wrote in hold what is served again."""
        for name in self.written(names):
            stash = self.stashes[name]
            stash.flat.copy_(stash.served)

    def status(self) -> Dict[str, Dict[str, Any]]:
        return {name: s.status() for name, s in list(self.stashes.items())}
