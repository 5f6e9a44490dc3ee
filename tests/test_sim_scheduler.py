"""scripts/sim_scheduler.py: mstar's Scheduler over synthetic speech streams
on a clock of step costs. The steady cadence follows from the costs, every
arrival is heard, and a long prompt in chunks costs a fixed-cost step each."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from sim_scheduler import FRAME_TOKENS, Costs, Sim, SimStream, simulate  # noqa: E402


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
