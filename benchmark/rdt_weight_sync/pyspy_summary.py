#!/usr/bin/env python3
"""Summarize a ``py-spy record --format raw`` profile of a weight-sync run.

py-spy's raw format is one line per distinct stack: frames joined by ``;``
(outermost first), a space, the sample count. This keeps the stacks that
pass through a marker (a file name such as ``local_lane.py``: the rank's
lane thread; ``trainer/lane.py``: the trainer's side of a lane call;
``receiver.py``: any pull) and prints, per marker, the functions below it
by inclusive samples, the leaf lines by samples (``--lines``) and the
parent → leaf pairs. Record with ``--gil`` to count only samples that hold
the GIL, without it to see where threads wait for it.

Example (a GPU profile of the rank's pulls and the client's update)::

    py-spy record --subprocesses --rate 1000 --gil --format raw -o prof.txt -- \\
        python benchmark/rdt_weight_sync/bench_pull.py --device cuda --same-gpu --workloads moe \\
        --modes fresh --rounds 30 --skip-ceiling --peers ""
    python benchmark/rdt_weight_sync/pyspy_summary.py prof.txt trainer/update.py receiver.py local_lane.py
"""

from __future__ import annotations

import argparse
import collections
import re
from typing import Dict, List

FRAME = re.compile(r"\((?:.*/)?([^/]+/[^/]+\.py):(\d+)\)")


def short(frame: str, lines: bool) -> str:
    """``fn (pkg/file.py:123)`` with the path cut to its last two parts."""
    return FRAME.sub(lambda m: f"({m.group(1)}:{m.group(2)})" if lines else f"({m.group(1)})", frame)


def summarize(path: str, markers: List[str], lines: bool, top: int) -> str:
    inclusive: Dict[str, collections.Counter] = {m: collections.Counter() for m in markers}
    leaves: Dict[str, collections.Counter] = {m: collections.Counter() for m in markers}
    pairs: Dict[str, collections.Counter] = {m: collections.Counter() for m in markers}
    totals: collections.Counter = collections.Counter()
    with open(path) as fh:
        for row in fh:
            stack, _, count = row.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            for marker in markers:
                if marker not in stack:
                    continue
                totals[marker] += n
                base = marker.rsplit("/", 1)[-1]
                first = max(i for i, f in enumerate(frames) if base in f)
                below = [short(f, lines) for f in frames[first:]]
                for f in set(below):
                    inclusive[marker][f] += n
                leaves[marker][below[-1]] += n
                if len(below) > 1:
                    pairs[marker][f"{below[-2]} -> {below[-1]}"] += n
    out = []
    for marker in markers:
        out.append(f"===== {marker}: {totals[marker]} samples")
        out += [f"{v:7d}  {k}" for k, v in inclusive[marker].most_common(top)]
        out.append("--- leaf frames")
        out += [f"{v:7d}  {k}" for k, v in leaves[marker].most_common(top)]
        out.append("--- parent -> leaf")
        out += [f"{v:7d}  {k}" for k, v in pairs[marker].most_common(top)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="py-spy record --format raw output")
    p.add_argument("markers", nargs="+", help="keep stacks through these files")
    p.add_argument("--lines", action="store_true", help="keep line numbers in frames")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    print(summarize(args.profile, args.markers, args.lines, args.top))


if __name__ == "__main__":
    main()
