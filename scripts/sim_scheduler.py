"""A scheduler simulator: mstar's own `Scheduler` (pure Python) driving
synthetic Orpheus speech streams on a clock of step costs measured on the
H200, to compare admission policies on the CPU in seconds.

    PYTHONPATH=. python scripts/sim_scheduler.py --out docs/benchmarks/scheduler_sim.json
    PYTHONPATH=. python scripts/sim_scheduler.py --mixed --out docs/benchmarks/scheduler_sim.json
    PYTHONPATH=. python scripts/sim_scheduler.py --mixed --budgets 8192 --pace-lead 0 0.25 0.5 1 2 \
        --step-host-ms 0 1.5 --out docs/benchmarks/scheduler_sim.json

Each stream: a prefill of its prompt (the `llm.prefill` queue, chunkable),
then one decode-group step per token; every 7 tokens make a frame, and from
the 4th frame on each frame queues a codec window (`codec.window`) whose
step sends the stream a chunk of 2048 samples (85.3 ms of audio). The last
frames leave in one short window. Steps run one after another; a step's
cost comes from `Costs` (the defaults fit docs/benchmarks/decode.md and
scheduler.md), plus `--step-host-ms` for the host's part, in series. What
the simulator leaves out: the worker's overlap of host and device work,
CUDA-graph buckets, page accounting and the HTTP path.

Scenarios, as `scripts/bench_scheduler.py` runs them on the GPU: `--streams`
long streams; then a short request every `--every` seconds; then one
`--long-prompt`-token prompt. Printed per policy (`--budgets`: the step's
token cap, `--max-num-batched-tokens`): the running streams' chunk gaps with
and without arrivals, the arrivals' time to first audio (p50, p90, and p50 of
the last 30 % of them), stalls (a chunk after the listener's player ran dry)
of the running streams and of the arrivals, the most audio a listener held
ahead, and the steps a second with arrivals (each pays `--step-host-ms`).

Pacing (`--pace-lead L`, `sim_pacing.py`): a row ahead of its listener by L
seconds sits out decode steps while another row lags, so that a lagging
row's step carries fewer rows' KV; a step costs the rows it ran. The real
`Scheduler` cannot step part of a group's window: it plans the whole window
(and sizes a mixed step's room for prompt tokens by it), and the simulator
drops the rows that sit out when it runs the plan. An engine would need
that in the scheduler and the worker (a gather of the rows that step).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mstar.scheduler import ModeCaps, Scheduler, WorkItem  # noqa: E402
from sim_pacing import (FRAME_S, FRAME_TOKENS, WINDOW_FRAMES, DecodeStep, Pacer, largest_lead,  # noqa: E402
                        step_measures)
from tts_report import percentile  # noqa: E402  (siblings: the script's folder is first on sys.path)

# arrivals past this share of their phase: with pacing, the running streams spend the lead they banked before
# the arrivals began first (cheap steps for the arrivals), and these arrivals see the steady state after it
LATE_SHARE = 0.7
MIXED_GRAPH_TOKENS = 507  # new tokens the largest mixed-step graph takes (512 less its padding rows)


@dataclass(frozen=True)
class Costs:
    """Milliseconds a step takes on the H200 (orpheus-3b): decode 4.1 ms at one
    row, 7.1 at 64, 16.9 at 256 (decode.md); a prefill step ~20 ms for a few
    tokens and ~88 ms for 4,000 (scheduler.md); a codec step ~2-3 ms."""

    decode_base: float = 4.0
    decode_per_row: float = 0.05
    prefill_base: float = 20.0
    prefill_per_token: float = 0.017
    codec_base: float = 2.0
    codec_per_row: float = 0.01
    # a mixed step (a decode step with new rows' prompt tokens, as a CUDA graph): 64 rows plus 8-128 new
    # tokens took 6.4-6.9 ms against 4.5 for the decode graph (scripts/probe_mixed.py)
    mixed_base: float = 1.9
    mixed_per_token: float = 0.004
    # the worker's own time a step (planning, launches), in series with the device's: every step pays it, so
    # more and smaller steps pay it more often (the real worker overlaps some of it with the device's work)
    step_host: float = 0.0

    def decode(self, rows: int) -> float:
        return self.decode_base + self.decode_per_row * rows

    def prefill(self, tokens: int) -> float:
        return self.prefill_base + self.prefill_per_token * tokens

    def codec(self, rows: int) -> float:
        return self.codec_base + self.codec_per_row * rows

    def mixed(self, rows: int, tokens: int) -> float:
        if tokens > MIXED_GRAPH_TOKENS:  # past the largest mixed graph: one eager forward, as a prefill costs
            return self.prefill(rows + tokens)
        return self.decode(rows) + self.mixed_base + self.mixed_per_token * tokens


@dataclass(eq=False)
class SimStream:
    name: str
    arrived: float
    prompt: int
    tokens: int                      # decode tokens to write
    kind: str                        # background | arrival | long
    written: int = 0
    chunks: list[float] = field(default_factory=list)
    finished: float = math.nan

    @property
    def frames(self) -> int:
        return self.written // FRAME_TOKENS


class Group:
    """The decode loop group as the scheduler sees it (`StandingGroup`)."""

    def __init__(self) -> None:
        self.ticket = -1
        self.rows: list[SimStream] = []
        self.mixes = True

    def __len__(self) -> int:
        return len(self.rows)

    def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
        return []

    def steps_room(self, most: int) -> int:
        return 1

    def pages(self, row: int) -> list[int]:
        return []


class Sim:
    def __init__(self, costs: Costs, budget: int, max_rows: int = 256, admit_every: int = 0,
                 mixed: bool = False, mix_tokens: int | None = None, pacer: Pacer | None = None) -> None:
        self.costs = costs
        self.pacer = pacer
        # what the steps cost the host, in `simulate`'s report
        self.decode_log: list[DecodeStep] = []
        self.step_ends: list[float] = []
        self._stepped: list[SimStream] = []
        caps = {("llm", "prefill"): ModeCaps(max_rows, budget), ("llm", "decode"): ModeCaps(max_rows, budget),
                ("codec", "window"): ModeCaps(max_rows, budget)}
        mix = {"llm": frozenset({"prefill", "decode"})} if mixed else None
        self.sched = Scheduler(caps, admit_every=admit_every, mix=mix,
                               mix_tokens=None if mix_tokens is None else {"llm": mix_tokens})
        self.group = Group()
        self.sched.add_group(("llm", "decode"), self.group)
        self.now = 0.0
        self.streams: list[SimStream] = []
        self.pending: list[SimStream] = []  # not arrived yet, by arrival time

    def arrive(self, stream: SimStream) -> None:
        self.streams.append(stream)
        self.pending.append(stream)
        self.pending.sort(key=lambda s: s.arrived)

    def _admit_arrivals(self) -> None:
        while self.pending and self.pending[0].arrived <= self.now:
            s = self.pending.pop(0)
            self.sched.add(WorkItem(s.name, "main", "llm", "prefill", num_tokens=s.prompt, payload=s,
                                    chunkable=True, starts_row=True))

    def run(self, until: float) -> None:
        while self.now < until:
            self._admit_arrivals()
            plan = self.sched.schedule()
            if plan is None:
                if not self.pending:
                    return
                self.now = max(self.now, self.pending[0].arrived)
                continue
            self.now += self.costs.step_host / 1e3
            if plan.group is not None:
                self._decode(plan.rows, plan.items)
            elif plan.component == "codec":
                self.now += self.costs.codec(len(plan.items)) / 1e3
                for item in plan.items:
                    item.payload.chunks.append(self.now)
            else:
                self._prefill(plan.items)
            self.step_ends.append(self.now)

    def _prefill(self, items: list[WorkItem]) -> None:
        self.now += self.costs.prefill(sum(i.chunk if i.chunkable else i.num_tokens for i in items)) / 1e3
        self._prefilled(items)

    def _prefilled(self, items: list[WorkItem]) -> None:
        for item in items:
            if item.partial:
                self.sched.next_chunk(item)
            else:
                stream = item.payload
                stream.written = 1  # the prefill samples the first token
                self.group.rows.append(stream)

    def _decode(self, rows: slice, new: list[WorkItem]) -> None:
        """A group step over `rows`, with `new` rows' prompt chunks in it (a
        mixed step); with pacing, over the rows of `rows` that the pacer picks
        (the real Scheduler plans the whole window: the subset is the simulator's)."""
        planned = window = self.group.rows[rows]
        if self.pacer is not None:
            window = self.pacer.choose(planned, self.now)
        if new:
            self.now += self.costs.mixed(len(window), sum(i.chunk for i in new)) / 1e3
        else:
            self.now += self.costs.decode(len(window)) / 1e3
        self.decode_log.append(DecodeStep(self.now, len(window), len(planned), window != self._stepped))
        self._stepped = window
        done = []
        for s in window:
            s.written += 1
            if s.written % FRAME_TOKENS == 0 and s.frames >= WINDOW_FRAMES:
                self.sched.add(WorkItem(s.name, "main", "codec", "window", payload=s))
            if s.written >= s.tokens:
                done.append(s)
                if s.frames >= 2:  # the last frames, in one short window
                    self.sched.add(WorkItem(s.name, "main", "codec", "window", payload=s))
        for s in done:
            self.group.rows.remove(s)
            s.finished = self.now
            if self.pacer is not None:
                self.pacer.forget(s)
            if s.kind == "background":  # its client's next request, at once (a closed loop)
                self.arrive(SimStream(f"{s.name}+", self.now, s.prompt, s.tokens, s.kind))
        self._prefilled(new)  # they join the group after its rows stepped


def _gaps(streams: list[SimStream], start: float, end: float) -> list[float]:
    return [b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:]) if start <= b < end]


def _stalls(streams: list[SimStream], start: float, end: float) -> int:
    late = 0
    for s in streams:
        if not s.chunks:
            continue
        dry = s.chunks[0] + FRAME_S
        for at in s.chunks[1:]:
            if at > dry:
                late += start <= at < end
                dry = at
            dry += FRAME_S
    return late


def simulate(a: argparse.Namespace, costs: Costs, budget: int, admit_every: int = 0,
             mixed: bool = False, mix_tokens: int | None = None, pace_lead: float = 0.0,
             pace_hysteresis: float = 0.0) -> dict[str, Any]:
    """One run of the three phases; `pace_lead` 0 runs every row every step."""
    pacer = Pacer(pace_lead, pace_hysteresis) if pace_lead else None
    sim = Sim(costs, budget, admit_every=admit_every, mixed=mixed, mix_tokens=mix_tokens, pacer=pacer)
    for i in range(a.streams):  # the background, staggered a little as clients start
        sim.arrive(SimStream(f"bg{i}", 0.002 * i, a.prompt, a.stream_tokens, "background"))
    ramp, phase = a.ramp, a.seconds
    n = 0
    t = ramp + phase
    while t < ramp + 2 * phase:
        sim.arrive(SimStream(f"new{n}", t, a.prompt, a.short_tokens, "arrival"))
        n += 1
        t += a.every
    t_long = ramp + 2 * phase + a.settle
    sim.arrive(SimStream("long", t_long, a.long_prompt, 2, "long"))
    sim.run(t_long + a.settle)
    bg = [s for s in sim.streams if s.kind == "background"]
    new = [s for s in sim.streams if s.kind == "arrival" and s.chunks]
    steady = _gaps(bg, ramp, ramp + phase)
    busy = _gaps(bg, ramp + phase, ramp + 2 * phase)
    long = next(s for s in sim.streams if s.kind == "long")
    window = (t_long, t_long + 0.5)
    ttfa = sorted(s.chunks[0] - s.arrived for s in new)
    late = [s.chunks[0] - s.arrived for s in new if s.arrived >= ramp + phase + LATE_SHARE * phase]
    alone = Sim(costs, budget)
    alone.arrive(SimStream("alone", 0.0, a.prompt, a.short_tokens, "arrival"))
    alone.run(10.0)
    one = alone.streams[0].chunks[0]
    return {
        "budget": budget,
        "admit_every": admit_every,
        "mixed": mixed,
        "mix_tokens": mix_tokens,
        "one_stream_ttfa_ms": round(one * 1e3, 1),
        "arrivals_ttfa_p50_ms": round(percentile(ttfa, 50) * 1e3, 1),
        "ttfa_ratio": round(percentile(ttfa, 50) / one, 2),
        "steady_gap_p50_ms": round(percentile(steady, 50) * 1e3, 1),
        "steady_gap_p99_ms": round(percentile(steady, 99) * 1e3, 1),
        "arrivals_gap_p50_ms": round(percentile(busy, 50) * 1e3, 1),
        "arrivals_gap_p99_ms": round(percentile(busy, 99) * 1e3, 1),
        "gap_p99_ratio": round(percentile(busy, 99) / percentile(steady, 99), 2),
        "long_prompt_max_gap_ms": round(max(_gaps(bg, *window), default=0.0) * 1e3, 1),
        "long_prompt_stalls": _stalls(bg, *window),
        "stalls": _stalls(bg, ramp, t_long + a.settle),
        "long_prompt_done_ms": round((long.finished - t_long) * 1e3, 1),
        "pace_lead_s": pace_lead,
        "pace_hysteresis_s": pace_hysteresis if pace_lead else 0.0,
        "step_host_ms": costs.step_host,
        "arrivals_ttfa_p90_ms": round(percentile(ttfa, 90) * 1e3, 1),
        "ttfa_p90_ratio": round(percentile(ttfa, 90) / one, 2),
        "late_ttfa_p50_ms": round(percentile(late, 50) * 1e3, 1),
        "late_ttfa_ratio": round(percentile(late, 50) / one, 2),
        "arrivals_stalls": _stalls(new, ramp, t_long + a.settle),
        "max_lead_s": round(largest_lead(bg + new, ramp, t_long + a.settle), 2),
    } | step_measures(sim.decode_log, sim.step_ends, ramp + phase, ramp + 2 * phase)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt", type=int, default=30, help="prompt tokens of a speech request")
    p.add_argument("--stream-tokens", type=int, default=2800)
    p.add_argument("--short-tokens", type=int, default=140)
    p.add_argument("--every", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--ramp", type=float, default=5.0)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--long-prompt", type=int, default=4000)
    p.add_argument("--budgets", type=int, nargs="+", default=[8192, 1024, 256])
    p.add_argument("--admit-every", type=int, nargs="+", default=[0],
                   help="Scheduler(admit_every=...): group steps between two steps that start rows")
    p.add_argument("--prefill-base-ms", type=float, default=Costs.prefill_base,
                   help="the fixed cost of a prefill step (what mixed steps or prefill graphs would cut)")
    p.add_argument("--mixed", action="store_true",
                   help="new rows' prompts ride in the decode group's steps (mixed steps, their measured cost)")
    p.add_argument("--mix-tokens", type=int, nargs="+", default=[None],
                   help="Scheduler(mix_tokens=...): most prompt tokens a mixed step takes")
    p.add_argument("--pace-lead", type=float, nargs="+", default=[0.0],
                   help="seconds of lead past which a row sits out decode steps while another row lags (0: off)")
    p.add_argument("--pace-hysteresis", type=float, nargs="+", default=[0.0],
                   help="a row that sat out rejoins once its lead falls this far under --pace-lead")
    p.add_argument("--step-host-ms", type=float, nargs="+", default=[0.0],
                   help="the worker's own time a step, added to every step's device cost")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--label", default=None, help="the runs' key in --out (default: from the policy flags)")
    a = p.parse_args()
    rows = [simulate(a, Costs(prefill_base=a.prefill_base_ms, step_host=host), budget, every, a.mixed, cap,
                     lead, hysteresis)
            for host in a.step_host_ms for hysteresis in a.pace_hysteresis for lead in a.pace_lead
            for every in a.admit_every for budget in a.budgets for cap in a.mix_tokens]
    keys = list(rows[0])
    print(" ".join(keys))
    for r in rows:
        print(" ".join(f"{str(r[k]):>{len(k)}}" for k in keys))
    if a.out is not None:
        costs = Costs(prefill_base=a.prefill_base_ms)  # each row says its step_host_ms
        report = json.loads(a.out.read_text()) if a.out.exists() else {}
        label = "mixed" if a.mixed else f"prefill_base_{a.prefill_base_ms:g}ms"
        label += "" if a.admit_every == [0] else "_admit_every"
        label += "" if a.mix_tokens == [None] else "_mix_tokens"
        label += "" if a.pace_lead == [0.0] else "_pacing"
        label += "" if a.pace_hysteresis == [0.0] else "_hysteresis"
        label += "" if a.step_host_ms == [0.0] else "_step_host"
        label = a.label or label
        report[label] = {"costs": costs.__dict__, "args": vars(a) | {"out": None}, "rows": rows}
        a.out.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
