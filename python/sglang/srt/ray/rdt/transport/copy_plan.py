"""Pure planning of device-to-device copies: ``(dst, src, nbytes)`` triples."""

from __future__ import annotations

from typing import List, Tuple

Copy = Tuple[int, int, int]


def plan_copies(copies: List[Copy]) -> List[Copy]:
    """Merge copies that continue each other on both sides; drop empty ones."""
    out: List[List[int]] = []
    for dst, src, n in copies:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1][2] += n
        else:
            out.append([dst, src, n])
    return [tuple(c) for c in out]  # type: ignore[misc]


def spread(copies: List[Copy], nstreams: int) -> List[List[Copy]]:
    """Split copies over ``nstreams`` queues, each about the same bytes, order kept."""
    nstreams = max(1, min(nstreams, len(copies)))
    total = sum(c[2] for c in copies)
    queues: List[List[Copy]] = [[] for _ in range(nstreams)]
    acc, q = 0, 0
    for c in copies:
        while q < nstreams - 1 and acc >= total * (q + 1) / nstreams:
            q += 1
        queues[q].append(c)
        acc += c[2]
    return [x for x in queues if x]
