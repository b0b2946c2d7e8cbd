"""LoRA adapter-only weight sync on a rank: register, land, commit (sglang #36384, miles #2756).

An adapter registered by name and PEFT config starts zeroed; its tensors travel in a weight update as
``"{lora_name}:{PEFT key}"`` (unsharded) and are served in place when it ends. The stash and the commit are
:mod:`sglang.srt.lora.adapter_stash`'s; an update's end commits what it wrote, a dropped one restores it.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from sglang.srt.lora.adapter_stash import SEP, AdapterStashes, split_name
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

    def end(self, state, weight_version: Optional[str]) -> Optional[Dict[str, int]]:
        """The update ``state`` holds ends: serve the adapters it wrote whole (one a broken pull wrote in goes back
        to what is served); a refusal marks their tensors failed. The bytes each served adapter moved, or None."""
        if not self.stashes.stashes:
            return None
        written = state.written_names()
        broken = state.written_names(broken=True)[len(written):]
        if broken:
            self.stashes.restore(broken)
            torn = set(self.stashes.written(broken))
            written = [n for n in written if (split_name(n) or ("",))[0] not in torn]
        try:
            return self.stashes.commit(written, self.port.lora_apply, weight_version)
        except Exception as e:
            reason = f"a LoRA adapter written in this update could not be served ({type(e).__name__}: {e})"
            logger.error("[RDT] %s", reason)
            state.transfer_failed([n for n in written if split_name(n)], reason)
            return None

    def drop(self, state) -> None:
        """The update ``state`` holds is dropped: the adapters it wrote in hold what is served again."""
        if self.stashes.stashes:
            self.stashes.restore(state.written_names(broken=True))

    def status(self) -> Dict[str, Dict[str, Any]]:
        return self.stashes.status()
