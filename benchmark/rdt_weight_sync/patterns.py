"""Deterministic contents, checked byte for byte.

Each tensor has base words computed from its index; update ``seed`` holds
``base ^ const(seed)``. The trainer fills its tensors for a seed, the rank
poisons its parameters before the update and checks every byte after it
against the pattern it computes itself.
"""

from __future__ import annotations

from typing import List, Sequence

import torch


def words_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 (or uint8) view."""
    b = t.reshape(-1).view(torch.uint8)
    return b.view(torch.int32) if b.numel() % 4 == 0 else b


def base_pattern(t: torch.Tensor, idx: int, chunk: int = 1 << 24) -> torch.Tensor:
    w = words_of(t)
    out = torch.empty_like(w)
    for start in range(0, w.numel(), chunk):
        n = min(chunk, w.numel() - start)
        x = torch.arange(start, start + n, dtype=torch.int64, device=t.device)
        x = x * 0x9E3779B1 + (idx * 0x632BE5AB + 0x1234567)
        x = x ^ (x >> 17)
        x = (x & 0x7FFFFFFF) * 0x7FEB352D
        x = x ^ (x >> 15)
        x = (x & 0xFFFFFFFF) - 0x80000000 if out.dtype == torch.int32 else x & 0xFF
        out[start:start + n] = x.to(out.dtype)
    return out


def seed_const(seed: int, dtype: torch.dtype) -> int:
    c = (seed * 0x01000193 + 0x5BD1E995) & 0x7FFFFFFF
    return c if dtype == torch.int32 else c & 0x7F


class Pattern:
    """Per-tensor base words of a list of tensors (kept on their device)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.base = [base_pattern(t, i) for i, t in enumerate(tensors)]

    def fill(self, tensors: Sequence[torch.Tensor], seed: int) -> None:
        for t, b in zip(tensors, self.base):
            torch.bitwise_xor(b, seed_const(seed, b.dtype), out=words_of(t))

    def check(self, tensors: Sequence[torch.Tensor], seed: int) -> List[int]:
        """The indices of the tensors that do not hold ``seed``'s bytes."""
        return [i for i, (t, b) in enumerate(zip(tensors, self.base))
                if not torch.equal(words_of(t) ^ seed_const(seed, b.dtype), b)]
