"""How a profiler trace's GPU time spreads over CUDA streams: per stream, the
time its kernels and copies kept it busy, the time any stream was busy (the
union) and the time two or more overlapped, against the traced window; and
the worker's own ranges (`mstar.*`, host time) by name. Reads the Chrome trace
that `torch.profiler` exports (`scripts/profile_omni.py --trace-dir`).

    python scripts/trace_streams.py trace.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _overlapped(intervals: dict[int, list[tuple[float, float]]]) -> float:
    """Time at least two streams were busy at once."""
    edges = []
    for spans in intervals.values():
        merged: list[list[float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        edges += [(a, 1) for a, _ in merged] + [(b, -1) for _, b in merged]
    edges.sort()
    busy, last, both = 0, 0.0, 0.0
    for t, d in edges:
        if busy >= 2:
            both += t - last
        busy += d
        last = t
    return both


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    streams: dict[int, list[tuple[float, float]]] = defaultdict(list)
    host: dict[str, list[float]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            streams[int(ev.get("args", {}).get("stream", -1))].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif cat == "user_annotation" and ev.get("name", "").startswith("mstar."):
            host[ev["name"]].append(ev["dur"])
    if not streams:
        print("no kernels in the trace")
        return
    start = min(a for spans in streams.values() for a, _ in spans)
    end = max(b for spans in streams.values() for _, b in spans)
    window = end - start
    print(f"window {window / 1e3:.1f} ms of GPU activity")
    for sid, spans in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        print(f"  stream {sid:>4}: busy {_union(spans) / 1e3:8.1f} ms ({100 * _union(spans) / window:5.1f}%), "
              f"{len(spans)} kernels/copies")
    union = _union([s for spans in streams.values() for s in spans])
    print(f"  any stream busy {union / 1e3:.1f} ms ({100 * union / window:.1f}%), two or more at once "
          f"{_overlapped(streams) / 1e3:.1f} ms")
    print("worker ranges (host, ms total / count / mean):")
    for name, durs in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:20]:
        print(f"  {name:40} {sum(durs) / 1e3:9.1f} {len(durs):6d} {sum(durs) / len(durs) / 1e3:8.3f}")


if __name__ == "__main__":
    main()
