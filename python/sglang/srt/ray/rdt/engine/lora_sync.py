"""LoRA adapter-only weight sync on a rank: register, land, commit (sglang #36384, miles #2756).

An adapter registered by name and PEFT config starts zeroed; its tensors travel in a weight update as
``"{lora_name}:{PEFT key}"`` (unsharded) and are served in place when it ends. The stash and the commit are
:mod:`sglang.srt.lora.adapter_stash`'s; an update's end commits what it wrote, a dropped one restores it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Optional

from sglang.srt.lora.adapter_stash import SEP, AdapterStashes
from sglang.srt.ray.rdt.errors import WeightSyncError, dtype_name

logger = logging.getLogger(__name__)


class RankLoRA:
    """A rank's registered adapters, over its port's ``lora_layout(config)`` and ``lora_apply(stash)``."""

    def __init__(self, port):
        self.port = port
        self.stashes = AdapterStashes()

    def register(self, lora_name: str, config: Dict[str, Any], lora_id: str) -> Dict[str, Any]:
        """Create the adapter zeroed (new name or config) or keep it. Returns what a trainer sends (names, shapes)."""
        if not lora_name or SEP in lora_name:
            raise WeightSyncError(f"a LoRA adapter name must be non-empty and without {SEP!r}: {lora_name!r}")
        layout, dtype, device = self.port.lora_layout(config)
        old = self.stashes.stashes.get(lora_name)
        stash, what = self.stashes.register(lora_name, lora_id, config, layout, dtype, device)
        if what != "unchanged":
            try:
                self.port.lora_apply(stash)  # served zeroed from now on: the base model's output
            except BaseException:  # refused: the adapter stays as it was
                self.stashes.put_back(lora_name, old)
                raise
            logger.info("[RDT] LoRA adapter %s %s: r=%s, %d tensors, %.1f MiB", lora_name, what,
                        config.get("r"), len(layout), stash.nbytes / 2**20)
        return {"lora_name": lora_name, "lora_id": stash.lora_id, "status": what,
                "r": config.get("r"), "lora_alpha": config.get("lora_alpha"), "dtype": dtype_name(dtype),
                "expected_tensors": {f"{lora_name}{SEP}{k}": list(t.shape) for k, t in stash.tensors.items()},
                "num_tensors": len(stash.tensors), "bytes": stash.nbytes, "checksum": stash.checksum}

    def named_tensors(self):
        return self.stashes.named_tensors()

    def commit(self, written: Iterable[str], weight_version: Optional[str]) -> Dict[str, int]:
        """The update ended: serve the adapters it wrote. Returns their bytes."""
        return self.stashes.commit(written, self.port.lora_apply, weight_version)

    def restore(self, written: Iterable[str]) -> None:
        self.stashes.restore(written)

    def status(self) -> Dict[str, Dict[str, Any]]:
        return self.stashes.status()
