"""Several decode steps a launch (`--num-scheduler-steps`) where streams
run between components: Orpheus's speech (the same audio as one step a
launch, its first codec window after the same decode step, on one device
and on two), `auto`'s choice between speech and text rows, and Qwen3-Omni's
thinker and talker (a talker's or an idle conversation's stream holds no
other request's launches)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

from launch_counts import launches, together
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.placement import parse_spec
from mstar.scheduler import LaunchSteps
from mstar.scheduler.plan import AUTO_STEPS
from mstar.types import GenerateRequest, SamplingParams

pytest.importorskip("transformers")


def _speaking(eng: Engine, i: int, max_tokens: int) -> Coroutine[Any, Any, np.ndarray]:
    """Seeded speech request `i` of Orpheus (tiny): its PCM."""
    async def speak() -> np.ndarray:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=7 + i)
        audio = b""
        async for chunk in eng.submit(GenerateRequest(f"s{i}", "orpheus-tiny", {"text": f"words {i}", "voice": "tara"},
                                                      sp)):
            assert chunk.error is None, chunk.error
            audio += chunk.audio or b""
        return np.frombuffer(audio, dtype="<i2").astype(np.int32)

    return speak()


async def _writing(eng: Engine, i: int, max_tokens: int) -> list[int]:
    """Greedy text request `i` through Orpheus (tiny)'s LLM walk: its tokens."""
    toks: list[int] = []
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for chunk in eng.submit(GenerateRequest(f"t{i}", "orpheus-tiny", {"prompt_ids": [1, 5 + i, 9]}, sp,
                                                  walk="generate")):
        assert chunk.error is None, chunk.error
        toks += chunk.token_ids
    return toks


async def test_auto_runs_speech_several_steps_a_launch_and_text_one() -> None:
    """auto: Orpheus's speech walks, whose tokens go to the codec, launch
    several steps; its LLM walk, whose tokens a client reads as they come,
    one; and so does a group holding both kinds of rows. By default, one."""
    auto = SchedulerConfig(num_scheduler_steps=None)
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=auto))
    await eng.start()
    _, launches = await together(eng, [_speaking(eng, i, 60) for i in range(4)])
    assert launches.count(AUTO_STEPS) >= 4
    eng = Engine(EngineConfig(model="orpheus-tiny"))
    await eng.start()
    _, launches = await together(eng, [_speaking(eng, i, 60) for i in range(4)])
    assert launches == []
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=auto))
    await eng.start()
    texts, launches = await together(eng, [_writing(eng, i, 40) for i in range(3)])
    assert [len(t) for t in texts] == [40] * 3 and launches == []
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=auto))
    await eng.start()
    both, launches = await together(eng, [_writing(eng, 0, 200)] + [_speaking(eng, i, 60) for i in range(3)])
    assert len(both[0]) == 200 and all(pcm.size for pcm in both[1:]) and launches == []


async def test_auto_keeps_one_step_for_a_model_that_streams_no_tokens_to_a_consumer() -> None:
    """auto: a model whose walks emit every token they stream (text alone)
    keeps one step a launch and none of the bookkeeping several need."""
    for model, want in (("tiny-llama", LaunchSteps(1, 1)), ("orpheus-tiny", LaunchSteps(AUTO_STEPS, 1))):
        eng = Engine(EngineConfig(model=model, scheduler=SchedulerConfig(num_scheduler_steps=None)))
        await eng.start()
        try:
            assert [w.scheduler.steps for w in eng.workers] == [want], model
        finally:
            await eng.shutdown()


async def _speech(steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Four seeded speech requests of Orpheus (tiny) decoding together; and
    the steps of each launch of several."""
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=SchedulerConfig(num_scheduler_steps=steps)))
    await eng.start()
    return await together(eng, [_speaking(eng, i, 35 + 9 * i) for i in range(4)])


async def test_speech_is_the_same_with_several_steps_a_launch() -> None:
    (one, none), (many, launches) = await _speech(1), await _speech(4)
    assert not none and launches.count(4) >= 4
    for a, b in zip(one, many):
        assert a.size > 0 and a.size == b.size
        assert np.abs(a - b).max() <= 2  # the same codes; codec windows may batch differently (float rounding)


async def _first_window_after(steps: int, split: bool = False) -> tuple[int, list[int]]:
    """One speech request of Orpheus (tiny): the decode steps the LLM had
    launched when the codec's first window ran, and the steps of each launch.
    `split`: the codec on a second device (the first count is then racy)."""
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=SchedulerConfig(num_scheduler_steps=steps),
                              **({"devices": ("cpu:0", "cpu:1"), "placement": parse_spec("split")} if split else {})))
    await eng.start()
    launched: list[int] = []    # the LLM's decode launches, in order
    first: list[int] = []       # decode steps launched before the first codec step

    def seen(r: StepReport) -> None:
        if r.component == "llm" and r.mode == "decode":
            launched.append(r.steps)
        elif r.component == "codec" and not first:
            first.append(sum(launched))

    eng.add_report_hook(seen)

    async def speak() -> None:
        sp = SamplingParams(max_tokens=80, temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=3,
                            ignore_eos=True)
        async for chunk in eng.submit(GenerateRequest("s", "orpheus-tiny", {"text": "words", "voice": "tara"}, sp)):
            assert chunk.error is None, chunk.error

    await together(eng, [speak()])
    assert first, "no codec step ran"
    return first[0], launched


async def test_a_first_window_waits_for_no_more_steps_than_with_one_step_a_launch() -> None:
    """Launches end at the step that completes a stream's first window, and
    run one step until its consumer has read it: the codec's first window
    runs after as many decode steps as with one step a launch, while later
    launches run several."""
    (one, _), (many, launched) = await _first_window_after(1), await _first_window_after(4)
    assert many == one
    assert launched.count(4) >= 4 and 1 in launched


async def test_a_first_window_on_another_device_is_sent_after_the_launch_that_completes_it() -> None:
    """The codec on a second device: a launch ends at the same step as with
    the codec beside the LLM (its first window's items go out once that
    launch is read), and later launches run several steps again."""
    _, here = await _first_window_after(4)
    _, split = await _first_window_after(4, split=True)
    end = here.index(3) + 1  # the launch that ends at the window's last item (4 x 6, then 3, on this model)
    assert split[:end] == here[:end] and sum(here[:end]) % 4
    assert split[end] == 1 and split[end + 1] == 4


async def _omni(steps: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Three seeded spoken answers of Qwen3-Omni (tiny): the thinker's
    tokens and the audio's length of each; and the launches of several steps."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", load_format="dummy",
                              scheduler=SchedulerConfig(num_scheduler_steps=steps)))
    await eng.start()

    async def speak(i: int) -> tuple[list[int], int]:
        tokens, audio = [], 0
        sp = SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True)
        request = GenerateRequest(f"o{i}", eng.model_name, {"messages": [{"role": "user", "content": f"hello {i}"}]},
                                  sp, walk="speak")
        async for chunk in eng.submit(request):
            assert chunk.error is None, chunk.error
            tokens += chunk.token_ids
            audio += len(chunk.audio or b"")
        return tokens, audio

    return await together(eng, [speak(i) for i in range(3)])


async def test_a_talkers_first_chunk_holds_no_other_requests_launches() -> None:
    """Qwen3-Omni: a chat answer's thinker runs several steps a launch while
    a spoken answer's talker reads the thinker's text (its consumer runs as
    a row of the talker's group, never idle), and no first chunk stays
    watched once the answers end."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", load_format="dummy",
                              scheduler=SchedulerConfig(num_scheduler_steps=4)))
    await eng.start()

    async def answer(rid: str, walk: str | None, tokens: int) -> None:
        sp = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=True)
        request = GenerateRequest(rid, eng.model_name, {"messages": [{"role": "user", "content": rid}]}, sp,
                                  walk=walk)
        async for chunk in eng.submit(request):
            assert chunk.error is None, chunk.error

    try:
        with launches(of="thinker") as thinker:
            await asyncio.gather(answer("spoken", "speak", 40), answer("chat", None, 40))
        assert thinker.count(4) >= 5
        assert not eng.workers[0].walker.streams._first
    finally:
        await eng.shutdown()


async def test_a_conversation_waiting_for_its_next_turn_holds_no_launches() -> None:
    """Qwen3-Omni in full duplex: while a conversation waits for its user's
    next turn (its streams' turn ended), a chat answer's thinker runs several
    steps a launch."""
    eng = Engine(EngineConfig(model="qwen3-omni-tiny", load_format="dummy",
                              scheduler=SchedulerConfig(num_scheduler_steps=4)))
    await eng.start()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    talk = GenerateRequest("c", eng.model_name, {"messages": [{"role": "user", "content": "hi"}]}, sp,
                           walk="converse", more_input=True, sampling_by={"talker": {"max_tokens": 8}})
    chat = GenerateRequest("chat", eng.model_name, {"messages": [{"role": "user", "content": "hello"}]},
                           SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True))
    waited = 0
    try:
        async for chunk in eng.submit(talk):
            assert chunk.error is None, chunk.error
            if chunk.awaiting_input:
                waited += 1
                with launches(of="thinker") as thinker:
                    async for out in eng.submit(chat):
                        assert out.error is None, out.error
                assert thinker.count(4) >= 5
                eng.close_input("c")
        assert waited == 1
    finally:
        await eng.shutdown()


async def test_a_thinker_steps_several_a_launch_beside_its_talker() -> None:
    """Qwen3-Omni: the thinker's plain token loop runs several steps a
    launch; the talker's (it reads the thinker's hidden states) one."""
    (one, none), (many, launches) = await _omni(1), await _omni(4)
    assert not none and launches.count(4) >= 1
    assert many == one and all(audio > 0 for _, audio in one)
