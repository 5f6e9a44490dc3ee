"""Two CPU devices (`cpu:0`, `cpu:1`), one worker thread each: a split
placement (a request's partitions on both, stream items crossing between
the workers) and replicas give the same tokens and audio as one device, and
aborted requests leave nothing behind on either."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fake_model import FakeModel

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.placement import parse_spec
from mstar.types import GenerateRequest, SamplingParams

TWO = ("cpu:0", "cpu:1")
SPEECH = SamplingParams(max_tokens=49, temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=11, ignore_eos=True)


async def _started(cfg: EngineConfig, model=None) -> Engine:
    eng = Engine(cfg, model=model)
    await eng.start()
    return eng


async def _drained(eng: Engine) -> None:
    for _ in range(3000):
        arenas = [w.arena for w in eng.workers if w.arena is not None]
        if (len(eng.store) == 0 and eng.store.num_owners() == 0 and eng.pages_in_use() == 0
                and eng.num_running() == 0 and not any(w.walker.runs or w.link.pending for w in eng.workers)
                and all(a.blocks_in_use == 0 for a in arenas)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not drained: {len(eng.store)} tensors, {eng.pages_in_use()} pages, "
                         f"{eng.num_running()} running")


async def _per_worker(eng: Engine, holds: Callable[[Any], bool], total: int) -> list[int]:
    """How many of each worker's running requests `holds`, once `total` do
    (the workers take their Submits on their own threads)."""
    def counts() -> list[int]:  # tuple(): one C call, while the worker threads may be adding runs
        return [sum(holds(run) for run in tuple(w.walker.runs.values())) for w in eng.workers]

    for _ in range(3000):
        if sum(counts()) == total:
            break
        await asyncio.sleep(0.01)
    return counts()


async def _speak_all(eng: Engine, texts: list[str]) -> list[tuple[bytes, str | None, int]]:
    async def one(i: int, text: str) -> tuple[bytes, str | None, int]:
        audio, last = b"", None
        async for chunk in eng.submit(GenerateRequest(f"s{i}", "orpheus-tiny", {"text": text}, SPEECH)):
            audio += chunk.audio or b""
            last = chunk
        assert last is not None
        return audio, last.finish_reason, last.num_output_tokens
    return await asyncio.gather(*[one(i, t) for i, t in enumerate(texts)])


@pytest.mark.parametrize("placement", ["split", "replicas", "llm=0+1,codec=1"])
async def test_orpheus_on_two_devices_speaks_as_on_one(placement: str) -> None:
    texts = ["hello there", "a second voice", "and a third one", "four"]
    one = await _started(EngineConfig(model="orpheus-tiny"))
    try:
        want = await _speak_all(one, texts)
    finally:
        await one.shutdown()
    two = await _started(EngineConfig(model="orpheus-tiny", devices=TWO, placement=parse_spec(placement)))
    try:
        got = await _speak_all(two, texts)
        health = two.health()
        await _drained(two)
    finally:
        await two.shutdown()
    for (a, ra, na), (b, rb, nb) in zip(want, got):
        x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
        assert x.size == y.size > 0 and (ra, na) == (rb, nb)
        assert np.abs(x - y).max() <= 2  # the same draws; batched vs unbatched convolutions round apart
    if placement == "split":
        assert health["placement"] == {"llm": ["cpu:0"], "codec": ["cpu:1"]}
        assert [d["components"] for d in health["devices"]] == [["llm"], ["codec"]]


@pytest.mark.parametrize(("devices", "spec", "part", "want"), [
    # the llm as two data-parallel copies: every request's codec on cpu:1 must not keep roots off cpu:1
    (TWO, "llm=0+1,codec=1", "llm", [2, 2]),
    # the codec on two devices: the codecs spread over them by the parts each runs
    (("cpu:0", "cpu:1", "cpu:2"), "llm=0,codec=1+2", "codec", [0, 2, 2]),
])
async def test_a_component_on_two_devices_takes_its_parts_on_both(devices: tuple[str, ...], spec: str, part: str,
                                                                 want: list[int]) -> None:
    eng = await _started(EngineConfig(model="orpheus-tiny", devices=devices, placement=parse_spec(spec)))
    try:
        long = SamplingParams(max_tokens=300, temperature=0.6, seed=3, ignore_eos=True)
        streams = [eng.submit(GenerateRequest(f"r{i}", "orpheus-tiny", {"text": f"text {i}"}, long))
                   for i in range(4)]
        assert await _per_worker(eng, lambda run: part in run.partitions, 4) == want
        for s in streams:
            eng.abort(s.request_id)
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_turns_cross_devices_too() -> None:
    greedy = SamplingParams(max_tokens=35, temperature=0.0, seed=5, ignore_eos=True)
    results = []
    for devices, spec in ((("cpu",), "replicas"), (TWO, "split")):
        eng = await _started(EngineConfig(model="orpheus-tiny", devices=devices, placement=parse_spec(spec)))
        try:
            stream = eng.submit(GenerateRequest("t", "orpheus-tiny", {"text": "one"}, greedy, more_input=True))
            eng.append("t", {"text": "two"})
            eng.close_input("t")
            audio = b"".join([c.audio or b"" async for c in stream])
            results.append(audio)
            await _drained(eng)
        finally:
            await eng.shutdown()
    assert len(results[0]) == len(results[1]) > 0
    a, b = (np.frombuffer(r, "<i2").astype(np.int32) for r in results)
    assert np.abs(a - b).max() <= 2


async def test_tensor_streams_cross_workers_in_order() -> None:
    """The fake counter loop writes stored tensors (not token ids): the stream
    items crossing to the summer on the other worker are tensor references."""
    eng = await _started(EngineConfig(model="fake", devices=TWO, placement=parse_spec("counter=0,doubler=0,summer=1")),
                         FakeModel(max_steps=9))
    try:
        chunks = [c async for c in eng.submit(GenerateRequest("r", "fake", {"x": 0}, SamplingParams(),
                                                               walk="stream"))]
        assert [tuple(c.data) for c in chunks if c.data is not None] == [(10, 4), (18, 4), (26, 4), (24, 3)]
        assert all(w.stats.steps > 0 for w in eng.workers)
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_aborts_on_two_devices_leave_nothing() -> None:
    eng = await _started(EngineConfig(model="fake", devices=TWO, placement=parse_spec("counter=0,doubler=0,summer=1")),
                         FakeModel(max_steps=10**6))
    try:
        streams = [eng.submit(GenerateRequest(f"r{i}", "fake", {"x": 0}, SamplingParams(), walk="stream"))
                   for i in range(6)]

        async def cut(i: int, stream) -> str | None:
            seen = 0
            async for chunk in stream:
                seen += 1
                if seen == 2 + i:
                    eng.abort(f"r{i}")
                if chunk.finished:
                    return chunk.finish_reason
            return None
        reasons = await asyncio.gather(*[cut(i, s) for i, s in enumerate(streams)])
        assert reasons == ["abort"] * 6
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_split_speech_with_host_arenas_aborted_midway_leaves_nothing() -> None:
    """Outputs staged through each worker's shared-memory arena (given here on
    the CPU too): whole requests and aborted ones give every block back."""
    eng = await _started(EngineConfig(model="orpheus-tiny", devices=TWO, placement=parse_spec("split"),
                                      host_arena_mb=8))
    try:
        assert all(w.arena is not None and w.arena.capacity == 8 << 20 for w in eng.workers)
        long = SamplingParams(max_tokens=400, temperature=0.6, seed=1, ignore_eos=True)

        async def run(i: int) -> tuple[str | None, int]:
            n, last = 0, None
            async for chunk in eng.submit(GenerateRequest(f"a{i}", "orpheus-tiny", {"text": f"text {i}"}, long)):
                n += len(chunk.audio or b"")
                if i % 2 and n >= 3 * 4096:
                    eng.abort(f"a{i}")
                last = chunk
            return (last.finish_reason if last else None), n
        results = await asyncio.gather(*[run(i) for i in range(4)])
        assert [r for r, _ in results] == ["length", "abort", "length", "abort"]
        assert all(n > 0 for _, n in results)
        text = eng.metrics_text()
        assert 'mstar_host_arena_bytes_in_use{device="cpu:1"}' in text
        lag_count = next(line for line in text.splitlines() if line.startswith("mstar_event_loop_lag_seconds_count"))
        assert float(lag_count.split()[-1]) > 0  # sampled every 10 ms while the requests ran
        await _drained(eng)
    finally:
        await eng.shutdown()


async def test_the_gil_switch_interval_is_set_while_serving_and_restored() -> None:
    import sys

    before = sys.getswitchinterval()
    eng = await _started(EngineConfig(model="fake", devices=TWO, gil_switch_interval_ms=0.5), FakeModel(max_steps=3))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        await eng.shutdown()
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("text_ends", ["first", "last"])
async def test_a_spoken_answer_cut_by_its_budget_on_another_device_ends_length(text_ends: str) -> None:
    """Qwen3-Omni's talker and code2wav on cpu:1, its thinker on cpu:0: the
    text stops on its own (a stop id) while the talker's frames run out at
    their `max_tokens` on the other worker, before the text ends or after.
    The request ends "length" there too, as on one device: its answer was
    cut short."""
    hello = {"messages": [{"role": "user", "content": "Say hello."}]}
    # the text's own sampling; a stop id it writes first at its 2nd token, or late (after the talker's 3 frames)
    text = SamplingParams(max_tokens=60, temperature=0 if text_ends == "first" else 1.0, seed=7, ignore_eos=True)
    results = []
    for devices, spec in ((("cpu",), None), (TWO, "thinker=0,audio=0,vision=0,talker=1,code2wav=1")):
        eng = await _started(EngineConfig(model="qwen3-omni-tiny", devices=devices, max_model_len=512,
                                          **({"placement": parse_spec(spec)} if spec else {})))
        try:
            chat = GenerateRequest("ids", "qwen3-omni-tiny", hello, text, walk="chat")
            ids = [t for c in [c async for c in eng.submit(chat)] for t in c.token_ids]
            at = 1 if text_ends == "first" else max(i for i in range(len(ids)) if ids[i] not in ids[:i])
            spoken = GenerateRequest("spoken", "qwen3-omni-tiny", {**hello, "voice": "ethan"},
                                     dataclasses.replace(text, stop_token_ids=(ids[at],)),
                                     walk="speak", sampling_by={"talker": {"max_tokens": 3, "ignore_eos": True,
                                                                           "temperature": 0}})
            chunks = [c async for c in eng.submit(spoken)]
            results.append((chunks[-1].finish_reason, sum(len(c.token_ids) for c in chunks), at + 1))
            await _drained(eng)
        finally:
            await eng.shutdown()
    assert results[0] == results[1] and results[0][0] == "length"
    assert results[0][1] == results[0][2] and (results[0][1] == 2) == (text_ends == "first")  # the text's stop held


async def test_a_part_failing_on_another_device_after_the_root_ended_fails_the_request() -> None:
    """The thinker (cpu:0) stops after two tokens; code2wav (cpu:1) then
    fails: the request ends "error" with its error, not as its root did."""
    hello = {"messages": [{"role": "user", "content": "Say hello."}]}
    eng = await _started(EngineConfig(model="qwen3-omni-tiny", devices=TWO, max_model_len=512,
                                      placement=parse_spec("thinker=0,audio=0,vision=0,talker=1,code2wav=1")))
    try:
        chat = GenerateRequest("ids", "qwen3-omni-tiny", hello,
                               SamplingParams(max_tokens=4, temperature=0, seed=7, ignore_eos=True), walk="chat")
        ids = [t for c in [c async for c in eng.submit(chat)] for t in c.token_ids]
        runner = eng.workers[1].runners["code2wav"]
        real, calls = runner.compute, [0]

        def failing(batch, inputs):  # its fourth frame, long after the thinker's two tokens
            calls[0] += 1
            if calls[0] >= 4:
                raise RuntimeError("code2wav broke")
            return real(batch, inputs)

        runner.compute = failing
        spoken = GenerateRequest("spoken", "qwen3-omni-tiny", {**hello, "voice": "ethan"},
                                 SamplingParams(max_tokens=8, temperature=0, seed=7, ignore_eos=True,
                                                stop_token_ids=(ids[1],)),
                                 walk="speak", sampling_by={"talker": {"max_tokens": 60, "stop_token_ids": [],
                                                                       "temperature": 0}})
        chunks = [c async for c in eng.submit(spoken)]
        assert calls[0] >= 4 and sum(len(c.token_ids) for c in chunks) == 2   # the text had ended first
        assert chunks[-1].finish_reason == "error" and "code2wav broke" in (chunks[-1].error or "")
        await _drained(eng)
    finally:
        await eng.shutdown()
