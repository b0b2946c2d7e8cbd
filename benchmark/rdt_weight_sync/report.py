"""Tables from ``bench_pull.py --json-out`` results (stdout, or Markdown for docs).

    python benchmark/rdt_weight_sync/report.py results.json [--markdown]

Every ratio is to the run's own ceiling: the one-tensor device copy of the
same bytes (``stable``/``fresh``, the peers and miles' loop), or the same
generator consumed in-process by a ``copy_`` loop (``stream``). Targets are
those of docs/performance.md (met / not met).
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Dict, List, Optional

GiB, MiB = 2**30, 2**20


def _steady(updates: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The updates after the first (cold) one; all of them when there is one."""
    return updates[1:] or updates


def client_row(name: str, res: Dict[str, Any], ceiling_s: float, bucket_bytes: int) -> Dict[str, Any]:
    ups = res["updates"]
    steady_ups = _steady(ups)
    steady = [u["seconds"] for u in steady_ups]
    med = statistics.median(steady)
    last = ups[-1]
    timeline_ms = {k: statistics.median(u["timeline"][k] for u in steady_ups) * 1e3
                   for k in TIMELINE + AFTER if all(k in (u.get("timeline") or {}) for u in ups)}
    return {
        "mode": name, "path": last.get("path"), "transport": last.get("transport"),
        "median_ms": med * 1e3, "ratio": ceiling_s / med if med else 0.0,
        "first_over_median": ups[0]["seconds"] / med if med else 0.0,
        "worst_over_median": max(steady) / med if med else 0.0,  # slowest update's time / median
        "peak_extra_mib": max(u["peak_extra_bytes"] for u in steady_ups) / MiB,
        "held_after_mib": max(u["held_after_bytes"] for u in steady_ups) / MiB,
        # gathered into the slots (not read where the trainer made it); what the staging pool holds
        "gathered_mib": max(u.get("gathered_bytes", 0) for u in ups) / MiB,
        "pool_mib": max(u.get("pool_bytes", 0) for u in ups) / MiB,
        "slot_mib": res.get("slot_bytes", 0) / MiB,
        "bound_mib": 2 * bucket_bytes / MiB,
        "bytes_ok": all(u["check"]["ok"] for u in ups), "updates": len(ups),
        "slowest": _slowest(steady_ups, med, timeline_ms),
        # where a steady update's time goes (medians, ms): the client describing
        # or copying its steps, the slowest rank's pulls (summed), ending the update
        "parts_ms": [statistics.median(u.get(k, 0.0) for u in steady_ups) * 1e3
                     for k in ("fill_seconds", "pull_seconds", "end_seconds")],
        "timeline_ms": timeline_ms,
    }


def _slowest(steady_ups: List[Dict[str, Any]], med: float, timeline_ms: Dict[str, float]) -> Optional[str]:
    """What the slowest steady update spent beyond a steady one's parts
    (``timeline_ms``: their medians), and the trainer's collections in it
    (None when it is within 1.25x the median)."""
    worst = max(steady_ups, key=lambda u: u["seconds"])
    if not med or worst["seconds"] <= 1.25 * med or not worst.get("timeline"):
        return None
    parts = []
    for k in TIMELINE:
        extra = worst["timeline"].get(k, 0.0) * 1e3 - timeline_ms.get(k, 0.0)
        if extra >= 0.5:
            parts.append(f"{k} +{extra:.1f} ms")
    if worst.get("generator_seconds") is not None:
        steady = statistics.median(u["generator_seconds"] for u in steady_ups)
        parts.append(f"the stream's generator {(worst['generator_seconds'] - steady) * 1e3:+.1f} ms")
    th = worst.get("trainer_thread")
    if th is not None:
        cpu = statistics.median(u["trainer_thread"]["cpu_seconds"] for u in steady_ups)
        pre = statistics.median(u["trainer_thread"]["preempted"] for u in steady_ups)
        parts.append(f"the trainer's thread on CPU {th['cpu_seconds'] * 1e3:.1f} ms (median {cpu * 1e3:.1f}), "
                     f"preempted {th['preempted']} times (median {pre:g})")
    gc_ = worst.get("trainer_gc")
    if gc_:
        parts.append("trainer collections (gen 0/1/2) " + "/".join(map(str, gc_["collections"]))
                     + f" in {gc_['seconds'] * 1e3:.1f} ms")
    return f"{worst['seconds'] * 1e3:.1f} ms vs median {med * 1e3:.1f}: " + ", ".join(parts)


# The parts of a steady update, in order (trainer.timeline).
TIMELINE = ("before_send", "to_rank", "pulls", "copy", "gaps", "after")
# ... and "after" in parts: the update's end on the rank, the answer's way back, the wait on a
# fenced pull's copy, the rest of the client's end.
AFTER = ("end_on_rank", "answer", "fence_wait", "client_end")


def simple_row(name: str, res: Dict[str, Any], ceiling_s: float) -> Dict[str, Any]:
    med = statistics.median(u["seconds"] for u in _steady(res["updates"]))
    return {"mode": name, "median_ms": med * 1e3, "ratio": ceiling_s / med if med else 0.0,
            "bytes_ok": all(u["check"]["ok"] for u in res["updates"])}


def summarize(results: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    bucket_bytes = results["meta"]["bucket_bytes"]
    for wname, w in results["workloads"].items():
        ceil = w.get("ceiling", {}).get("one_tensor", {}).get("seconds")
        stream_ceil = w.get("stream_ceiling", {}).get("seconds")
        rows, others = [], []
        for key, res in (w.get("client") or {}).items():
            base = stream_ceil if key.startswith("stream") else ceil
            if base and res.get("updates"):
                rows.append(client_row(key, res, base, bucket_bytes))
        for key, res in (w.get("peer") or {}).items():
            if ceil and res.get("updates"):
                others.append(simple_row(f"peer: torch CUDA IPC, {key.replace('_', ' ')}", res, ceil))
        if w.get("lora", {}).get("updates"):
            lo = w["lora"]
            med = statistics.median(u["seconds"] for u in _steady(lo["updates"]))
            port = statistics.median(u["check"].get("apply_seconds", 0.0) for u in _steady(lo["updates"]))
            others.append({"mode": f"LoRA adapter only ({lo['tensors']} tensors, {lo['bytes'] / MiB:.0f} MiB; "
                                   f"{port * 1e3:.1f} ms of it the port's copy into the adapter's slot)",
                           "median_ms": med * 1e3, "ratio": ceil / med if ceil and med else 0.0,
                           "first_over_median": lo["updates"][0]["seconds"] / med if med else 0.0,
                           "bytes_ok": all(u["check"]["ok"] for u in lo["updates"])})
        if w.get("miles", {}).get("updates") and ceil:
            others.append(simple_row("miles' loop (one bucket, put + pull per bucket)", w["miles"], ceil))
        out[wname] = {"info": w.get("info", {}), "client": rows, "others": others,
                      "ceiling": w.get("ceiling", {}), "stream_ceiling": w.get("stream_ceiling"),
                      "errors": w.get("errors", {})}
    return out


# Trainer modes whose tensors are made outside the staging pool (trainer.OUTSIDE).
OUTSIDE = ("outside", "cat", "cast", "views", "strided")


def targets(summary: Dict[str, Any]) -> List[str]:
    """The same-GPU targets (docs/performance.md), each marked met or not met."""
    lines = []
    for wname, s in summary.items():
        best_peer = max((r["ratio"] for r in s["others"] if r["mode"].startswith("peer")), default=None)
        moe = wname in ("moe", "mixed-moe")
        for r in s["client"]:
            mode, checks = r["mode"], []
            if mode in ("stable", "fresh"):
                want = 0.75 if moe else 0.8
                checks.append((f"{r['ratio']:.2f}x >= {want}x", r["ratio"] >= want))
            elif mode.startswith("stream"):
                checks.append((f"{r['ratio']:.2f}x its ceiling >= 0.6x", r["ratio"] >= 0.6))
            elif mode in OUTSIDE:
                checks.append((f"{r['ratio']:.2f}x >= 0.45x", r["ratio"] >= 0.45))
                if best_peer:
                    checks.append((f"{r['ratio'] / best_peer:.2f}x the best peer >= 2x", r["ratio"] >= 2 * best_peer))
                checks.append((f"peak extra {r['peak_extra_mib']:.0f} MiB <= two slots ({r['bound_mib']:.0f})",
                               r["peak_extra_mib"] <= r["bound_mib"] + 64))
                checks.append((f"held after {r['held_after_mib']:.0f} MiB", r["held_after_mib"] <= 1))
            else:
                continue
            if mode in ("stable", "fresh") or mode.startswith("stream"):
                checks.append((f"first {r['first_over_median']:.2f}x median <= 1.5x", r["first_over_median"] <= 1.5))
                checks.append((f"slowest {r['worst_over_median']:.2f}x median <= 1.25x",
                               r["worst_over_median"] <= 1.25))
                checks.append((f"held after {r['held_after_mib']:.0f} MiB", r["held_after_mib"] <= 1))
            if mode.startswith("stream"):  # two buckets + the tensor being made
                bound = r["bound_mib"] + s["info"].get("largest_tensor_bytes", 0) / MiB
                checks.append((f"peak extra {r['peak_extra_mib']:.0f} MiB", r["peak_extra_mib"] <= bound + 64))
            for text, ok in checks:
                lines.append(f"{wname} {mode}: {text}: {'met' if ok else 'NOT met'}")
        for r in s["others"]:
            if r["mode"].startswith("LoRA"):
                lines.append(f"{wname} LoRA: whole update {r['median_ms']:.2f} ms <= 5 ms: "
                             f"{'met' if r['median_ms'] <= 5 else 'NOT met'}")
                lines.append(f"{wname} LoRA: first {r['first_over_median']:.2f}x median <= 1.5x: "
                             f"{'met' if r['first_over_median'] <= 1.5 else 'NOT met'}")
            if r["mode"].startswith("miles") and wname in ("uniform", "qwen3-4b", "moe"):
                want = 0.1 if moe else 0.2
                lines.append(f"{wname} miles' loop: {r['ratio']:.2f}x >= {want}x: "
                             f"{'met' if r['ratio'] >= want else 'NOT met'}")
    return lines


def markdown(summary: Dict[str, Any], meta: Dict[str, Any]) -> str:
    out = []
    for wname, s in summary.items():
        info, ceil = s["info"], s["ceiling"].get("one_tensor", {})
        gbps = info.get("bytes", 0) / ceil["seconds"] / 1e9 if ceil.get("seconds") else 0
        out.append(f"#### {wname}: {info.get('tensors')} tensors, {info.get('bytes', 0) / GiB:.2f} GiB "
                   f"({info.get('dtype')}); one-tensor copy {gbps:.0f} GB/s")
        out.append("")
        out.append("| trainer | path | whole update | ratio | fill / pulls / end | first / median | "
                   "slowest / median | peak extra | held after | bytes |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in s["client"]:
            gathered = f", {r['gathered_mib']:.0f} MiB gathered" if r["gathered_mib"] else ""
            out.append(f"| {r['mode']} | {r['path']} ({r['transport']}{gathered}) | {r['median_ms']:.1f} ms | "
                       f"**{r['ratio']:.2f}x** | {' / '.join(f'{v:.1f}' for v in r['parts_ms'])} ms | "
                       f"{r['first_over_median']:.2f} | {r['worst_over_median']:.2f} | "
                       f"{r['peak_extra_mib']:.0f} MiB | {r['held_after_mib']:.0f} MiB"
                       f"{' (slots)' if r['slot_mib'] else ''} | {'ok' if r['bytes_ok'] else 'FAIL'} |")
        for r in s["others"]:
            out.append(f"| {r['mode']} | | {r['median_ms']:.1f} ms | {r['ratio']:.2f}x | | | | | | "
                       f"{'ok' if r['bytes_ok'] else 'FAIL'} |")
        rows = [(k, v) for k, v in s["ceiling"].items() if isinstance(v, dict) and "seconds" in v]
        if rows:
            out.append("")
            out.append("Copies in one process: " + "; ".join(
                f"{v['label']} {info.get('bytes', 0) / v['seconds'] / 1e9:.0f} GB/s" for _, v in rows))
        if s.get("stream_ceiling"):
            out.append(f"Stream ceiling (the generator + a copy_ loop in-process): "
                       f"{s['stream_ceiling']['seconds'] * 1e3:.1f} ms")
        timed = [r for r in s["client"] if r["timeline_ms"]]
        if timed:
            out.append("")
            out.append("Where a steady update's time goes (ms; medians): " + " / ".join(TIMELINE)
                       + " (" + " + ".join(AFTER) + ")")
            out.append("")
            for r in timed:
                t = r["timeline_ms"]
                parts = " + ".join(f"{t[k]:.2f}" for k in AFTER) if all(k in t for k in AFTER) else ""
                out.append(f"- {r['mode']}: " + " / ".join(f"{t[k]:.2f}" for k in TIMELINE)
                           + (f" ({parts})" if parts else ""))
        slow = [r for r in s["client"] if r.get("slowest")]
        if slow:
            out.append("")
            out.append("Slowest updates past 1.25x the median:")
            out.append("")
            for r in slow:
                out.append(f"- {r['mode']}: {r['slowest']}")
        for k, v in s["errors"].items():
            out.append(f"ERROR {k}: {v}")
        out.append("")
    return "\n".join(out)


def byte_check(results: Dict[str, Any]) -> bool:
    ok = True
    for w in results["workloads"].values():
        for section in ("client", "peer"):
            for res in (w.get(section) or {}).values():
                ok &= all(u["check"]["ok"] for u in res.get("updates", []))
        for key in ("miles", "lora"):
            ok &= all(u["check"]["ok"] for u in (w.get(key) or {}).get("updates", []))
        ok &= all(v.get("bytes_ok", True) for v in (w.get("ceiling") or {}).values() if isinstance(v, dict))
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = json.load(open(argv[0]))
    summary = summarize(results)
    print(markdown(summary, results["meta"]))
    for line in targets(summary):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
