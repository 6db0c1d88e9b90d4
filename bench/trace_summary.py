#!/usr/bin/env python3
"""Summarises a Perfetto / Chrome trace (the *.trace.json.gz that jax.profiler.trace(...,
create_perfetto_trace=True) writes, or any Chrome-format trace) as JSON lines: per process and
thread (a GPU stream or a host thread), the busy time, the span and the idle gaps, and the events
that take the most time. Use it to see where a step's time goes and which stream waits.

usage: trace_summary.py TRACE [--top 15] [--match REGEX]
"""
import argparse
import collections
import gzip
import json
import re


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--match", default="", help="only events whose name matches this regex")
    a = ap.parse_args()
    events = load(a.trace)
    names = {}
    for e in events:  # process / thread names from the metadata events
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    rx = re.compile(a.match) if a.match else None
    lanes = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if rx and not rx.search(e.get("name", "")):
            continue
        lanes[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), e.get("name", "")))
    for (pid, tid), evs in sorted(lanes.items(), key=lambda kv: -sum(d for _, d, _ in kv[1])):
        evs.sort()
        busy, end = 0.0, None  # the union of the intervals: nested events count once
        for t, d, _ in evs:
            if end is None or t >= end:
                busy += d
                end = t + d
            elif t + d > end:
                busy += t + d - end
                end = t + d
        span = evs[-1][0] + evs[-1][1] - evs[0][0]
        gaps, end, last = [], None, ""
        for t, d, n in evs:
            if end is not None and t > end:
                gaps.append((t - end, last, n))
            if end is None or t + d > end:
                end, last = t + d, n
        gaps = sorted(gaps, reverse=True)[:5]
        by_name = collections.Counter()
        for _, d, n in evs:
            by_name[n] += d
        print(json.dumps({
            "process": names.get(("process_name", pid, None), str(pid)), "thread": names.get(("thread_name", pid, tid), str(tid)),
            "events": len(evs), "busy_ms": round(busy / 1e3, 3), "span_ms": round(span / 1e3, 3),
            "largest_gaps_ms": [[round(g / 1e3, 3), before[:60], after[:60]] for g, before, after in gaps],
            "top": [[n[:80], round(d / 1e3, 3)] for n, d in by_name.most_common(a.top)]}))


if __name__ == "__main__":
    main()
