"""A served model's greedy answer to one prompt with each position's top-5
logprobs: what the tests of output-changing options (fp8 projections, float8
KV pages) compare against the unchanged model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


def greedy_top5(config: EngineConfig, prompt: list[int], tokens: int = 12,
                inspect: Callable[[Engine], Any] | None = None) -> tuple[list[int], list[dict[int, float]], Any]:
    """The greedy tokens, each position's top-5 {token: logprob}, and what
    `inspect` reads of the engine before it shuts down (None without one)."""
    async def run() -> tuple[list[int], list[dict[int, float]], Any]:
        eng = Engine(config)
        await eng.start()
        try:
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
            out_tokens: list[int] = []
            top: list[dict[int, float]] = []
            async for out in eng.submit(GenerateRequest("r", eng.model_name, {"prompt_ids": prompt}, params)):
                assert out.error is None, out.error
                out_tokens += out.token_ids
                top += [dict(lp.top) for lp in out.logprobs or ()]
            return out_tokens, top, inspect(eng) if inspect is not None else None
        finally:
            await eng.shutdown()
    return asyncio.run(run())
