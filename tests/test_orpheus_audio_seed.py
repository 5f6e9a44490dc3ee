"""Orpheus audio is a function of the request: with a seed, the same speech
comes back alone or in a crowd (the codec's noise is seeded per request and
window by the runtime, not drawn from a shared generator)."""

from __future__ import annotations

import asyncio

import numpy as np

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


async def _speak(eng: Engine, rid: str, text: str, seed: int | None, temperature: float = 0.6) -> bytes:
    sp = SamplingParams(max_tokens=63, temperature=temperature, top_p=0.8, repetition_penalty=1.3, seed=seed,
                        ignore_eos=True)
    audio = b""
    async for chunk in eng.submit(GenerateRequest(rid, "orpheus-tiny", {"text": text, "voice": "tara"}, sp)):
        audio += chunk.audio or b""
    return audio


async def test_seeded_speech_is_the_same_alone_and_batched() -> None:
    eng = Engine(EngineConfig(model="orpheus-tiny"))
    await eng.start()
    try:
        alone = await _speak(eng, "alone", "the quick brown fox", seed=11)
        crowd = await asyncio.gather(*[_speak(eng, f"c{i}", "the quick brown fox" if i == 2 else f"other {i}",
                                              seed=11 if i == 2 else 100 + i) for i in range(4)])
        a = np.frombuffer(alone, dtype="<i2").astype(np.int32)
        b = np.frombuffer(crowd[2], dtype="<i2").astype(np.int32)
        assert a.size > 0 and a.size == b.size
        # the same draws; only float rounding of a batched vs unbatched conv differs
        assert np.abs(a - b).max() <= 2
        other = np.frombuffer(crowd[0], dtype="<i2").astype(np.int32)
        n = min(other.size, a.size)
        assert other.size != a.size or np.abs(other[:n] - a[:n]).max() > 100
    finally:
        await eng.shutdown()


async def test_greedy_speech_without_a_seed_repeats() -> None:
    """Temperature 0 and no seed: the tokens are greedy, and the codec's noise follows a fixed seed, so the
    same text gives the same audio; sampled speech without a seed does not repeat."""
    eng = Engine(EngineConfig(model="orpheus-tiny"))
    await eng.start()
    try:
        first, second = [np.frombuffer(await _speak(eng, f"g{i}", "the quick brown fox", None, 0.0), dtype="<i2")
                         for i in range(2)]
        assert first.size > 0 and np.array_equal(first, second)
        a, b = [np.frombuffer(await _speak(eng, f"s{i}", "the quick brown fox", None), dtype="<i2").astype(np.int32)
                for i in range(2)]
        n = min(a.size, b.size)
        assert a.size != b.size or np.abs(a[:n] - b[:n]).max() > 100
    finally:
        await eng.shutdown()
