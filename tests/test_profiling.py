"""Engine.profile: torch's profiler over a worker thread's steps."""

from __future__ import annotations

import asyncio

import pytest
from profile_support import DEADLINE_S, ProfileGate

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


async def test_profile_records_the_worker_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        # however slowly the worker runs, the profile lasts until a step of the request ran inside it
        ProfileGate(eng, monkeypatch, held=False, steps=1)
        sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        stream = eng.submit(GenerateRequest("r", eng.model_name, {"prompt_ids": [5, 6, 7]}, sp))
        chunks = aiter(stream)
        try:
            first = await asyncio.wait_for(anext(chunks), DEADLINE_S)
            assert first.token_ids and not first.finished
            # its first token is out, so its prefill is done: every step from here on is a decode step
            prof = await asyncio.wait_for(eng.profile(0.05), DEADLINE_S)
        finally:
            await chunks.aclose()  # the request is aborted
        names = {e.key for e in prof.key_averages()}
        assert {"mstar.llm.decode", "mstar.finalize"} <= names
        assert any(n.startswith("aten::") for n in names)  # the worker thread's ops, not the event loop's
    finally:
        await eng.shutdown()
