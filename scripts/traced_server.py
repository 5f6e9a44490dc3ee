"""`python -m mstar.http` with a timeline of what its engine did, for a
benchmark to explain a burst's first audio.

Runs the server exactly as `python -m mstar.http ARGS` does, with an engine
that also notes, on the event loop: each request's `prepare` (its body read
and parsed: about when its handler began) and `submit`, each step report
(worker, component, mode, rows, the step's time and its device part), and
when each request's first chunk reached the event loop. At exit (the
benchmark's SIGTERM) it writes them as JSON to `$MSTAR_TRACE_OUT`.
`bench_server.py`'s `--server-trace FILE` starts this in place of the
server; `--report FILE` prints a written timeline burst by burst:

    MSTAR_TRACE_OUT=/tmp/t.json python scripts/traced_server.py --model orpheus-tiny --gpus cpu
    python scripts/traced_server.py --report /tmp/t.json

Times are `time.perf_counter()` seconds of the server's process. Each note
costs the event loop a list append; the first-chunk note a set lookup per
emitted row.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BURST_GAP_S = 0.5  # submits further apart than this start a new burst in the report


class Timeline:
    """What the engine did, in the order the event loop saw it."""

    def __init__(self) -> None:
        self.prepared: dict[str, float] = {}
        self.submitted: dict[str, float] = {}
        self.first_chunk: dict[str, float] = {}
        self.steps: list[tuple[float, str, str, str, int, float, float]] = []

    def on_report(self, r: Any) -> None:
        now = time.perf_counter()
        if r.mode:
            self.steps.append((now, r.device, r.component, r.mode, r.rows, r.step_s, r.device_s))
        for batch in r.emits:
            for rid in batch.request_ids:
                if rid not in self.first_chunk:
                    self.first_chunk[rid] = now

    def dump(self, path: str) -> None:
        Path(path).write_text(json.dumps({"prepared": self.prepared, "submitted": self.submitted,
                                          "first_chunk": self.first_chunk, "steps": self.steps}))


def traced_engine(timeline: Timeline) -> type:
    """`Engine` with the timeline's notes (imported here: torch comes with it)."""
    from mstar.engine.engine import Engine

    class TracedEngine(Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.add_report_hook(timeline.on_report, before=True)

        async def prepare(self, request: Any) -> Any:
            timeline.prepared.setdefault(request.request_id, time.perf_counter())
            return await super().prepare(request)

        def submit(self, request: Any, prepared: Any = None) -> Any:
            stream = super().submit(request, prepared)
            timeline.submitted[request.request_id] = time.perf_counter()
            return stream

    return TracedEngine


def serve(argv: list[str]) -> int:
    out = os.environ.get("MSTAR_TRACE_OUT")
    if not out:
        print("error: set MSTAR_TRACE_OUT to the file the timeline goes to", file=sys.stderr)
        return 2
    import mstar.engine.engine as engine_module
    from mstar.http.__main__ import main

    timeline = Timeline()
    engine_module.Engine = traced_engine(timeline)  # `serve` imports Engine from there when it starts
    atexit.register(timeline.dump, out)
    return main(argv)


def bursts(submitted: dict[str, float]) -> list[list[str]]:
    """Request ids grouped into bursts: runs of submits under `BURST_GAP_S` apart."""
    groups: list[list[str]] = []
    last = None
    for rid, t in sorted(submitted.items(), key=lambda kv: kv[1]):
        if last is None or t - last > BURST_GAP_S:
            groups.append([])
        groups[-1].append(rid)
        last = t
    return groups


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1e3:.1f} (min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})"


def report(path: Path) -> None:
    """Per burst: how its requests came in, and every step from its first
    submit until its last first chunk."""
    t = json.loads(path.read_text())
    prepared, submitted, first = t["prepared"], t["submitted"], t["first_chunk"]
    steps = [tuple(s) for s in t["steps"]]
    for n, ids in enumerate(bursts(submitted)):
        t0 = min(prepared.get(r, submitted[r]) for r in ids)
        sub = [submitted[r] for r in ids]
        done = [first[r] for r in ids if r in first]
        print(f"## burst {n}: {len(ids)} requests, {len(done)} with a first chunk")
        print(f"  prepare -> submit ms: {_ms([submitted[r] - prepared[r] for r in ids if r in prepared])}")
        print(f"  submits spread over {(max(sub) - min(sub)) * 1e3:.1f} ms after the first prepare at "
              f"+{(min(sub) - t0) * 1e3:.1f} ms")
        print(f"  submit -> first chunk ms: {_ms([first[r] - submitted[r] for r in ids if r in first])}")
        if not done:
            continue
        end = max(done)
        print("  +ms at report   worker  component.mode  rows  step ms  device ms  submitted by then  first chunks")
        for at, device, comp, mode, rows, step_s, device_s in steps:
            if t0 <= at <= end + 1e-3:
                by = sum(1 for s in sub if s <= at)
                got = sum(1 for d in done if d <= at)
                print(f"  {(at - t0) * 1e3:10.1f}  {device:>7}  {comp + '.' + mode:>14}  {rows:4d}  "
                      f"{step_s * 1e3:7.2f}  {device_s * 1e3:9.2f}  {by:17d}  {got:12d}")


def main_cli() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        report(Path(sys.argv[2]))
        return 0
    if "--help" in sys.argv[1:2]:
        argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).print_help()
        return 0
    return serve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main_cli())
