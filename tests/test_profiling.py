"""Engine.profile: torch's profiler over a worker thread's steps."""

from __future__ import annotations

import asyncio

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


async def test_profile_records_the_worker_steps() -> None:
    eng = Engine(EngineConfig(model="tiny-llama"))
    await eng.start()
    try:
        async def run() -> None:
            sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            async for _ in eng.submit(GenerateRequest("r", eng.model_name, {"prompt_ids": [5, 6, 7]}, sp)):
                pass

        profiling = asyncio.create_task(eng.profile(1.0))  # an idle worker starts it at once
        await asyncio.sleep(0.05)
        await run()
        prof = await profiling
        names = {e.key for e in prof.key_averages()}
        assert {"mstar.llm.decode", "mstar.finalize"} <= names
        assert any(n.startswith("aten::") for n in names)  # the worker thread's ops, not the event loop's
    finally:
        await eng.shutdown()
