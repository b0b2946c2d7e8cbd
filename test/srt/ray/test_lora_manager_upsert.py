"""sglang's LoRAManager.upsert_lora_adapter_from_tensors (patch 0029): an adapter replaced in place, and a
replacement that fails leaving the adapter as it was.

The manager's own method runs on a stand-in for the rest of the manager (the memory pool, the loader), so the
failures a live server cannot be made to produce on demand (a slot that rejects the weights part-way, an
overlapped load still in flight) are driven directly; the live servers of test_lora_sync.py cover the rest.
"""

from __future__ import annotations

import types
from typing import List

import pytest

from conftest import LORA_TARGETS
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.lora.lora_registry import LoRARef

CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS, "bias": "none",
          "task_type": "CAUSAL_LM"}
REF = LoRARef(lora_id="id-1", lora_name="rl", lora_path="__tensor__", pinned=False)


class Pool:
    """The memory pool: the adapter resident in slot 3; records what happens to it, in order."""

    def __init__(self, events: List[str], fits: bool = True, fail_after_writing: bool = False):
        self.events, self.fits, self.fail = events, fits, fail_after_writing
        self.uid_to_buffer_id = {REF.lora_id: 3}
        self.slot = "old weights"

    def can_support(self, config) -> bool:
        return self.fits

    def load_lora_weight_to_buffer(self, uid, slot, adapter, *modules):
        self.events.append(f"write slot {slot}")
        self.slot = f"part of {adapter}" if self.fail else adapter
        if self.fail:
            raise ValueError("LoRA buffer shape mismatch")

    def remove_lora(self, uid):
        self.events.append("empty slot")
        self.slot = None
        return self.uid_to_buffer_id.pop(uid)


class Event:
    def __init__(self, events: List[str]):
        self.events = events

    def synchronize(self):
        self.events.append("overlapped load landed")


def manager(pool: Pool, pending=None):
    m = types.SimpleNamespace(
        loras={REF.lora_id: "old adapter"}, configs={REF.lora_id: "old config"}, lora_refs={REF.lora_id: REF},
        memory_pool=pool, base_hf_config=types.SimpleNamespace(vocab_size=256), enable_lora_overlap_loading=False,
        pending_lora_load_events=dict(pending or {}), lora_modules=[], embed_tokens_module=None,
        lm_head_module=None, notified=[])
    m.load_lora_weights_from_tensors = lambda ref, tensors, keep_device: m.loras.__setitem__(ref.lora_id, "new adapter")
    m._notify_lora_slots_updated = m.notified.append
    m.create_lora_update_result = lambda success, error_message="": LoRAManager.create_lora_update_result(
        m, success, error_message)
    return m


def upsert(m):
    return LoRAManager.upsert_lora_adapter_from_tensors(m, REF, {}, CONFIG, keep_device=True)


def test_a_replacement_rewrites_the_resident_slot_in_place():
    events = []
    m = manager(Pool(events))
    out = upsert(m)
    assert out.success, out.error_message
    assert m.loras[REF.lora_id] == "new adapter" and m.configs[REF.lora_id].r == 8
    assert m.memory_pool.slot == "new adapter" and m.memory_pool.uid_to_buffer_id == {REF.lora_id: 3}
    assert events == ["write slot 3"] and m.notified == [{3}]


def test_a_slot_that_rejects_the_new_weights_part_way_is_emptied_and_the_old_adapter_kept():
    events = []
    m = manager(Pool(events, fail_after_writing=True))
    out = upsert(m)
    assert not out.success and "LoRA buffer shape mismatch" in out.error_message
    assert m.loras[REF.lora_id] == "old adapter" and m.configs[REF.lora_id] == "old config"
    # the half-written slot serves nothing: the next batch loads the old adapter into a slot again
    assert events == ["write slot 3", "empty slot"] and m.memory_pool.slot is None
    assert REF.lora_id not in m.memory_pool.uid_to_buffer_id and m.notified == [{3}]


def test_a_config_the_pool_cannot_take_leaves_the_adapter_and_its_slot_untouched():
    events = []
    m = manager(Pool(events, fits=False))
    out = upsert(m)
    assert not out.success and "--max-lora-rank" in out.error_message
    assert m.loras[REF.lora_id] == "old adapter" and m.configs[REF.lora_id] == "old config"
    assert events == [] and m.memory_pool.slot == "old weights" and m.notified == []


@pytest.mark.parametrize("fails", [False, True])
def test_an_overlapped_load_of_the_slot_lands_before_the_slot_is_rewritten(fails):
    events = []
    m = manager(Pool(events, fail_after_writing=fails), pending={REF.lora_id: Event(events)})
    out = upsert(m)
    assert out.success is not fails
    assert events[:2] == ["overlapped load landed", "write slot 3"]
    assert m.pending_lora_load_events == {}
