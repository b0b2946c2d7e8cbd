"""Whether the host's CPU runs at one speed: a fixed pure-Python workload, timed back to back.

A stream's update is as fast as the trainer's thread makes and describes its
tensors, so an update runs slower when that thread's CPU does. This probe
times one fixed workload (no CUDA, no Ray, one thread) over and over for
``seconds`` and prints the spread: median, p10 / p90, the share of runs over
1.25x the median and the longest stretch of them, and the median of each
second over the whole median (a run of slow seconds is a slow phase of the
host, not of anything this probe does). usage:
``python benchmark/rdt_weight_sync/host_probe.py [seconds] [label]``
"""

from __future__ import annotations

import statistics
import sys
import time


def workload() -> int:
    s = 0
    for i in range(60000):
        s += i * i
    return s


def probe(seconds: float) -> list:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        workload()
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list, label: str) -> str:
    med = statistics.median(times)
    q = sorted(times)
    longest = cur = 0
    for t in times:
        cur = cur + 1 if t > 1.25 * med else 0
        longest = max(longest, cur)
    slow = sum(t > 1.25 * med for t in times) / len(times)
    per_second, acc, spent = [], [], 0.0
    for t in times:
        acc.append(t)
        spent += t
        if spent >= 1.0:
            per_second.append(statistics.median(acc) / med)
            acc, spent = [], 0.0
    return (f"{label}: {len(times)} runs, median {med * 1e3:.2f} ms, p10 {q[len(q) // 10] * 1e3:.2f}, "
            f"p90 {q[9 * len(q) // 10] * 1e3:.2f}, max {q[-1] * 1e3:.2f}; over 1.25x the median "
            f"{slow * 100:.1f} %, longest stretch {longest} runs ({longest * med * 1e3:.0f} ms)\n"
            f"{label}: each second's median / the median: " + " ".join(f"{p:.2f}" for p in per_second))


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    print(summary(probe(seconds), sys.argv[2] if len(sys.argv) > 2 else "host"), flush=True)
