"""scripts/sim_scheduler.py: mstar's Scheduler over synthetic speech streams
on a clock of step costs. The steady cadence follows from the costs, every
arrival is heard, and a long prompt in chunks costs a fixed-cost step each.
Pacing (scripts/sim_pacing.py) off is the simulator as it was; on, rows ahead
of their listeners sit out while others lag, never a row before its first
audio, and steps cost the rows they ran."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sim_scheduler  # noqa: E402
from sim_pacing import FRAME_S, Pacer, Streaming, lead  # noqa: E402
from sim_scheduler import FRAME_TOKENS, Costs, Sim, SimStream, simulate  # noqa: E402

# simulate(_args(streams=32, every=0.1), Costs(), 8192, mixed=True) before pacing existed (at 1d422a0)
BEFORE_PACING = {
    "budget": 8192, "admit_every": 0, "mixed": True, "mix_tokens": None, "one_stream_ttfa_ms": 135.9,
    "arrivals_ttfa_p50_ms": 195.8, "ttfa_ratio": 1.44, "steady_gap_p50_ms": 43.5, "steady_gap_p99_ms": 43.5,
    "arrivals_gap_p50_ms": 47.2, "arrivals_gap_p99_ms": 83.9, "gap_p99_ratio": 1.93, "long_prompt_max_gap_ms": 68.7,
    "long_prompt_stalls": 0, "stalls": 0, "long_prompt_done_ms": 40.0,
}


def _args(**kw: object) -> argparse.Namespace:
    base = dict(streams=4, prompt=30, stream_tokens=700, short_tokens=70, every=0.25, seconds=2.0, ramp=1.0,
                settle=1.0, long_prompt=600)
    return argparse.Namespace(**(base | kw))


def test_a_lone_stream_hears_a_chunk_every_frame_of_decode_steps() -> None:
    costs = Costs()
    sim = Sim(costs, budget=8192)
    sim.arrive(SimStream("s", 0.0, 30, 70, "arrival"))
    sim.run(10.0)
    chunks = sim.streams[0].chunks
    # frames 4..10 each queue a window; the last frames leave in one short window
    assert len(chunks) == 70 // FRAME_TOKENS - 4 + 1 + 1
    step = (costs.decode(1) * FRAME_TOKENS + costs.codec(1)) / 1e3
    assert chunks[2] - chunks[1] == pytest.approx(step)
    # 27 decode steps write tokens 2..28; the window they complete queues behind the group's next step,
    # whose ticket was renewed as it was planned
    first = (costs.prefill(30) + costs.decode(1) * 4 * FRAME_TOKENS + costs.codec(1)) / 1e3
    assert chunks[0] == pytest.approx(first)


def test_arrivals_are_all_heard_and_the_long_prompt_ends() -> None:
    row = simulate(_args(), Costs(), 8192)
    assert row["arrivals_ttfa_p50_ms"] > row["one_stream_ttfa_ms"] > 0
    assert row["steady_gap_p50_ms"] > 0 and row["arrivals_gap_p99_ms"] >= row["steady_gap_p50_ms"]
    assert row["long_prompt_done_ms"] > Costs().prefill(600)


def test_chunking_a_long_prompt_takes_a_prefill_step_per_chunk() -> None:
    whole = simulate(_args(), Costs(), 8192)["long_prompt_done_ms"]
    chunked = simulate(_args(), Costs(), 100)["long_prompt_done_ms"]
    assert chunked - whole >= (600 // 100 - 1) * Costs().prefill_base


def test_mixed_steps_take_arrivals_into_decode_steps_at_their_cost() -> None:
    costs = Costs()
    sim = Sim(costs, budget=8192, mixed=True)
    sim.arrive(SimStream("running", 0.0, 30, 700, "arrival"))
    sim.run(0.1)  # its own prefill (no group yet), then decode steps
    before = sim.now
    sim.arrive(SimStream("new", sim.now, 30, 70, "arrival"))
    sim.run(before + (costs.mixed(1, 30) + costs.decode(2)) / 1e3 + 1e-9)
    # the arrival rode in the running row's next step, and its row stepped in the one after: sooner than a
    # prefill step of its own would have ended (20 ms)
    assert [s.name for s in sim.group.rows] == ["running", "new"] and sim.streams[1].written >= 2
    assert (sim.now - before) * 1e3 < costs.prefill(30)
    plain = simulate(_args(), costs, 8192)
    mixed = simulate(_args(), costs, 8192, mixed=True)
    assert mixed["mixed"] and mixed["arrivals_gap_p99_ms"] < plain["arrivals_gap_p99_ms"]


def test_pacing_off_is_the_simulator_as_it_was() -> None:
    row = simulate(_args(streams=32, every=0.1), Costs(), 8192, mixed=True)
    assert {k: row[k] for k in BEFORE_PACING} == BEFORE_PACING
    # a hysteresis without a lead changes nothing either
    assert simulate(_args(streams=32, every=0.1), Costs(), 8192, mixed=True, pace_lead=0.0, pace_hysteresis=0.1) == row
    assert row["pace_lead_s"] == 0.0 and row["paced_step_share"] == 0.0 and row["arrivals_stalls"] == 0
    assert row["rows_per_decode_step"] > 32  # every running row, every step


def test_pacing_lowers_the_arrivals_ttfa_without_a_stall() -> None:
    args = _args(streams=32, every=0.1, short_tokens=140)
    off = simulate(args, Costs(), 8192, mixed=True)
    on = simulate(args, Costs(), 8192, mixed=True, pace_lead=0.25)
    assert off["ttfa_ratio"] == 1.5 and on["ttfa_ratio"] == 1.11
    assert on["late_ttfa_ratio"] < off["late_ttfa_ratio"] and on["ttfa_p90_ratio"] < off["ttfa_p90_ratio"]
    assert on["stalls"] == on["arrivals_stalls"] == on["long_prompt_stalls"] == 0
    # more and smaller steps: the running streams sit out most of them
    assert on["decode_steps_per_s"] > 1.3 * off["decode_steps_per_s"]
    assert on["rows_per_decode_step"] < off["rows_per_decode_step"] / 4
    # the running streams banked seconds of lead before the arrivals began: they sit out every step of them
    assert on["paced_step_share"] == 1.0 and off["paced_step_share"] == 0.0 and on["max_lead_s"] > 1.0


def test_a_row_before_its_first_audio_is_never_sat_out(monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = SimStream("ahead", 0.0, 30, 700, "background", written=28 + 20 * FRAME_TOKENS, chunks=[0.0])
    queued = SimStream("queued", 0.0, 30, 700, "arrival", written=28)  # its first window waits for the codec
    new = SimStream("new", 0.0, 30, 700, "arrival", written=1)
    assert lead(ahead, 0.5) == pytest.approx(21 * FRAME_S - 0.5) and lead(queued, 0.5) == -math.inf
    pacer = Pacer(0.25)
    assert pacer.choose([ahead, queued, new], 0.5) == [queued, new]
    assert pacer.choose([ahead], 0.5) == [ahead]  # no row lags: it steps rather than idle the device
    left_out: list[Streaming] = []
    tested = 0  # steps that sat rows out beside a row before its first audio

    class Watching(Pacer):
        def choose(self, rows: Sequence[Streaming], now: float) -> list[Streaming]:
            nonlocal tested
            stepping = super().choose(rows, now)
            left_out.extend(s for s in rows if not s.chunks and s not in stepping)
            tested += len(stepping) < len(rows) and any(not s.chunks for s in rows)
            return stepping

    monkeypatch.setattr(sim_scheduler, "Pacer", Watching)
    row = simulate(_args(streams=32, every=0.1), Costs(), 8192, mixed=True, pace_lead=0.25, pace_hysteresis=0.1)
    assert row["paced_step_share"] == 1.0 and left_out == [] and tested > 400  # 459 at writing


def _beside_16_ahead(costs: Costs, pacer: Pacer | None) -> tuple[float, list[tuple[float, int]]]:
    """A request arriving at 3 s beside 16 streams that run ~2x real time (each
    ~4 s ahead of its listener by then): its TTFA, and the decode steps (end,
    rows) from its arrival to its first chunk."""
    sim = Sim(costs, 8192, pacer=pacer)
    for i in range(16):
        sim.arrive(SimStream(f"bg{i}", 0.0, 30, 2800, "background"))
    sim.run(3.0)
    start = sim.now
    sim.arrive(SimStream("new", start, 30, 140, "arrival"))
    sim.run(start + 0.5)
    first = sim.streams[-1].chunks[0]
    return first - start, [(s.end, s.rows) for s in sim.decode_log if start < s.end <= first]


def test_a_paced_step_costs_the_rows_it_stepped() -> None:
    costs = Costs()
    alone = Sim(costs, 8192)
    alone.arrive(SimStream("alone", 0.0, 30, 140, "arrival"))
    alone.run(1.0)
    one = alone.streams[0].chunks[0]
    paced, steps = _beside_16_ahead(costs, Pacer(0.25))
    # after the group step it arrived behind and its own prefill step, its 28 decode steps ran it alone
    assert [rows for _, rows in steps] == [16] + [1] * 28
    assert [b - a for (a, _), (b, _) in zip(steps[1:], steps[2:])] == pytest.approx([costs.decode(1) / 1e3] * 27)
    assert paced - one == pytest.approx(costs.decode(16) / 1e3)
    # unpaced, each of its steps carried the 16 rows (and their codec steps came between)
    unpaced, steps = _beside_16_ahead(costs, None)
    assert [rows for _, rows in steps] == [16] + [17] * 28
    assert unpaced - one > 28 * (costs.decode(17) - costs.decode(1)) / 1e3


def test_every_step_pays_the_host_cost() -> None:
    plain, host = Sim(Costs(), 8192), Sim(Costs(step_host=1.5), 8192)
    for sim in (plain, host):
        sim.arrive(SimStream("s", 0.0, 30, 70, "arrival"))
        sim.run(10.0)
    # a prefill step, 28 decode steps and a codec step before the first chunk
    assert host.streams[0].chunks[0] - plain.streams[0].chunks[0] == pytest.approx(30 * 1.5e-3)
    assert len(host.step_ends) == len(plain.step_ends) and host.now - plain.now == pytest.approx(
        len(host.step_ends) * 1.5e-3)


def test_pacing_needs_a_hysteresis_under_its_lead() -> None:
    with pytest.raises(ValueError):
        Pacer(0.25, 0.25)
    with pytest.raises(ValueError):
        Pacer(0.0)
