"""Sampled token ids enter streams as host ints, the prefill's first token
included: a codec window is then built on the host in one copy, and a batch
of windows never mixes rows on the device with rows on the host."""

from __future__ import annotations

import pytest

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.worker.streaming.edges import Streams
from mstar.types import GenerateRequest, SamplingParams


@pytest.mark.parametrize("steps", [1, None])  # one decode step a launch, and auto (several, for speech)
async def test_token_streams_carry_host_ints(monkeypatch: pytest.MonkeyPatch, steps: int | None) -> None:
    """A decode group's tokens come through `feed_ids` (which hands some rows on to `feed`), a row's
    several of a launch together; the prefill's through `feed`."""
    fed: list[object] = []
    original, original_ids = Streams.feed, Streams.feed_ids
    grouped = [False]

    def spy(self, part, value, item):
        if value == "token" and part.request.walk.streams.get(value) and not grouped[0]:
            fed.append(item)
        return original(self, part, value, item)

    def spy_ids(self, parts, value, ids):
        if value == "token":  # one id a row, or each row's ids of a launch of several steps
            fed.extend(i for row in ids for i in (row if isinstance(row, list) else (row,)))
        grouped[0] = True
        try:
            return original_ids(self, parts, value, ids)
        finally:
            grouped[0] = False

    monkeypatch.setattr(Streams, "feed", spy)
    monkeypatch.setattr(Streams, "feed_ids", spy_ids)
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=SchedulerConfig(num_scheduler_steps=steps)))
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=30, temperature=0.6, seed=3, ignore_eos=True)
        audio = b""
        async for chunk in eng.submit(GenerateRequest("r", "orpheus-tiny", {"text": "hello"}, sp)):
            audio += chunk.audio or b""
    finally:
        await eng.shutdown()
    assert len(fed) == 30, "the prefill's token and every decode token"
    assert all(type(item) is int for item in fed), [type(i) for i in fed if type(i) is not int]
    assert audio
