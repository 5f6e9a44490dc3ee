"""The engine over fake components: loops with host stops that arrive late,
streams with both chunk policies, fan-out, faults and aborts."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from fake_model import FakeModel, StepGate
from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.graph import Emit, Loop, MaxSteps, Step, Walk
from mstar.types import GenerateRequest, SamplingParams


async def _engine(model: FakeModel, devices: tuple[str, ...] = ("cpu",)) -> Engine:
    eng = Engine(EngineConfig(model="fake", devices=devices), model=model)
    await eng.start()
    return eng


async def _collect(eng: Engine, rid: str, walk: str, x: int = 0):
    chunks = [c async for c in eng.submit(GenerateRequest(rid, "fake", {"x": x}, SamplingParams(), walk=walk))]
    return chunks


async def _drained(eng: Engine) -> None:
    for _ in range(3000):
        if len(eng.store) == 0 and eng.store.num_owners() == 0 and not any(
                w.scheduler.has_work() or w.walker.runs for w in eng.workers):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not drain: {len(eng.store)} tensors held")


async def test_late_host_stop_drops_the_speculative_step() -> None:
    gate = StepGate(last=5)  # ticks 0-4 write 1-5; tick 5's 6 comes after the stop
    model = FakeModel(gate=gate)
    model.limit = 5
    eng = await _engine(model)
    eng.add_report_hook(gate.before_report, before=True)
    eng.add_report_hook(gate.after_report)
    try:
        chunks = await _collect(eng, "r1", "count")
        assert gate.failure is None, gate.failure
        values = [t for c in chunks for t in c.token_ids]
        assert values == [1, 2, 3, 4, 5]
        assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
        await _drained(eng)
        # the step that computed 6 ran before the stop arrived; its output was dropped
        assert model.counter.calls == 6
        assert eng.stats["outputs_dropped"] == 1
        # and the step after it, already queued, was cancelled, not run
        assert eng.workers[0].stats.cancelled_steps == 1
    finally:
        await eng.shutdown()


async def test_device_stop_rule_ends_with_length() -> None:
    eng = await _engine(FakeModel(max_steps=4))
    try:
        chunks = await _collect(eng, "r1", "count", x=10)
        assert [t for c in chunks for t in c.token_ids] == [11, 12, 13, 14]
        assert chunks[-1].finish_reason == "length"
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_sliding_window_stream_runs_concurrently_and_flushes() -> None:
    eng = await _engine(FakeModel(max_steps=9))
    try:
        chunks = await _collect(eng, "r1", "stream")
        sums = [tuple(c.data) for c in chunks if c.data is not None]
        # items 1..9, windows of 4 every 2, then the next window cut short: 7, 8, 9
        assert sums == [(10, 4), (18, 4), (26, 4), (24, 3)]
        assert chunks[-1].finished
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_fixed_chunks_stream_flushes_a_short_last_chunk() -> None:
    eng = await _engine(FakeModel(max_steps=7))
    try:
        chunks = await _collect(eng, "r1", "chunks")
        assert [tuple(c.data) for c in chunks if c.data is not None] == [(6, 3), (15, 3), (7, 1)]
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_fanout_branches_run_as_partitions() -> None:
    eng = await _engine(FakeModel())
    try:
        chunks = await _collect(eng, "r1", "fanout", x=1)
        got = sorted(c.data for c in chunks if c.data is not None)
        # y = 2 from the root; branch a loops y 3, 4, 5; branch b writes z = 4
        assert got == [2, 3, 4, 4, 5]
        assert chunks[-1].finished
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_many_concurrent_streams_share_batches() -> None:
    eng = await _engine(FakeModel(max_steps=9))
    try:
        results = await asyncio.gather(*[_collect(eng, f"r{i}", "stream", x=i) for i in range(20)])
        for i, chunks in enumerate(results):
            sums = [c.data[0] for c in chunks if c.data is not None]
            assert sums == [4 * i + 10, 4 * i + 18, 4 * i + 26, 3 * i + 24]
        assert eng.workers[0].stats.rows > eng.workers[0].stats.steps  # rows did share steps
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_fault_in_a_step_fails_that_step_and_the_worker_survives() -> None:
    model = FakeModel(max_steps=6)
    model.counter.fail_on = 3
    eng = await _engine(model)
    try:
        chunks = await _collect(eng, "bad", "count", x=0)
        assert chunks[-1].finish_reason == "error" and "injected fault" in (chunks[-1].error or "")
        model.counter.fail_on = None
        ok = await _collect(eng, "good", "count", x=100)
        assert [t for c in ok for t in c.token_ids] == [101, 102, 103, 104, 105, 106]
        assert eng.health()["status"] == "ok"
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_row_that_breaks_its_step_fails_alone() -> None:
    """Rows batched with one whose input makes the step raise go on: the step
    runs again row by row, and only the bad row fails."""
    first = threading.Event()
    model = FakeModel(gate=lambda n: first.wait(timeout=30) if n == 0 else None, max_steps=4)
    model.counter.fail_on = 503
    eng = await _engine(model)
    try:
        # the first tick holds the worker, so the other four queue and run as one batch
        streams = {rid: eng.submit(GenerateRequest(rid, "fake", {"x": x}, SamplingParams(), walk="count"))
                   for rid, x in (("holder", 0), ("a", 100), ("b", 200), ("bad", 503), ("c", 300))}
        await asyncio.sleep(0.2)
        first.set()
        results = {rid: [c async for c in s] for rid, s in streams.items()}
        for rid, start in (("holder", 0), ("a", 100), ("b", 200), ("c", 300)):
            assert results[rid][-1].finish_reason == "length", results[rid][-1]
            assert [t for c in results[rid] for t in c.token_ids] == [start + 1, start + 2, start + 3, start + 4]
        assert results["bad"][-1].finish_reason == "error" and "injected fault" in (results["bad"][-1].error or "")
        assert eng.workers[0].stats.failed_steps == 1  # the batch once; the retries alone were single rows
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_rows_of_two_walks_binding_other_names_share_a_mode_and_both_finish() -> None:
    """One (component, mode) queue batches rows of different walks; a call
    names values after one step, so rows whose steps bind other names run on
    their own instead of failing together or taking the worker down."""
    first = threading.Event()
    model = FakeModel(gate=lambda n: first.wait(timeout=30) if n == 0 else None, max_steps=3)
    model.walks["count_y"] = Walk(Step("counter", "tick", "x", "y"), Loop(Step("counter", "tick", "y", "y"),
                                                                         until=MaxSteps(3)),
                                  Emit("y"), inputs=("x",))
    eng = await _engine(model)
    try:
        streams = [eng.submit(GenerateRequest("hold", "fake", {"x": 0}, SamplingParams(), walk="count")),
                   eng.submit(GenerateRequest("x", "fake", {"x": 10}, SamplingParams(), walk="count")),
                   eng.submit(GenerateRequest("y", "fake", {"x": 20}, SamplingParams(), walk="count_y"))]
        await asyncio.sleep(0.2)
        first.set()
        results = [[c async for c in s] for s in streams]
        values = [[t for c in r for t in c.token_ids] or [c.data for c in r if c.data is not None] for r in results]
        assert values == [[1, 2, 3], [11, 12, 13], [21, 22, 23]]
        assert all(r[-1].finish_reason == "length" for r in results)
        assert eng.health()["status"] == "ok"
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_abort_mid_stream_frees_everything() -> None:
    eng = await _engine(FakeModel(max_steps=10**6))
    try:
        stream = eng.submit(GenerateRequest("long", "fake", {"x": 0}, SamplingParams(), walk="stream"))
        seen = 0
        async for chunk in stream:
            seen += 1
            if seen == 3:
                eng.abort("long")
            if chunk.finished:
                assert chunk.finish_reason == "abort"
        await _drained(eng)
        assert eng.num_running() == 0
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("devices", [("cpu:0", "cpu:1")])
async def test_two_cpu_workers_split_requests(devices: tuple[str, ...]) -> None:
    eng = await _engine(FakeModel(max_steps=5), devices)
    try:
        results = await asyncio.gather(*[_collect(eng, f"r{i}", "count", x=i) for i in range(8)])
        for i, chunks in enumerate(results):
            assert [t for c in chunks for t in c.token_ids] == [i + 1, i + 2, i + 3, i + 4, i + 5]
        assert all(w.stats.steps > 0 for w in eng.workers)
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_audio_emits_reach_the_client_as_pcm16() -> None:
    import numpy as np

    eng = await _engine(FakeModel(max_steps=5))
    try:
        chunks = await _collect(eng, "r1", "audio", x=3)
        audio = [c for c in chunks if c.audio is not None]
        assert [c.modality for c in audio] == ["audio"] * 3 and {c.sample_rate for c in audio} == {24_000}
        pcm = np.frombuffer(b"".join(c.audio for c in audio), dtype="<i2")
        # items 4..8 in chunks of 2 (the last one short), each item 4 samples of item / 10, clamped
        expected = np.repeat(np.clip(np.arange(4, 9) / 10.0, -1, 1), 4)
        assert np.array_equal(pcm, np.round(expected * 32767).astype("<i2"))
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_a_stream_takes_only_items_in_its_accept_range() -> None:
    eng = await _engine(FakeModel(max_steps=9))
    try:
        chunks = await _collect(eng, "r1", "filtered")
        # items 1..9, of which 3..6 enter, in chunks of 2
        assert [tuple(c.data) for c in chunks if c.data is not None] == [(7, 2), (11, 2)]
        await _drained(eng)
    finally:
        await eng.shutdown()


def test_pcm16_rows_of_different_lengths_convert_as_each_alone() -> None:
    """A list of waveform rows (a first frame is shorter: code2wav cuts what
    came before the sequence) converts in one pass and slices back per row."""
    from mstar.engine.eventloop.pcm import pcm16

    g = torch.Generator().manual_seed(3)
    rows = [torch.rand(7, generator=g) * 2.4 - 1.2, torch.zeros(0), torch.rand(2, 3, generator=g) * 2 - 1]
    alone = [(r.reshape(-1).clamp(-1, 1) * 32767.0).round().to(torch.int16).numpy().tobytes() for r in rows]
    assert pcm16(rows) == alone and [len(b) for b in alone] == [14, 0, 12]
    assert pcm16([]) == []
