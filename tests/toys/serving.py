"""What the toys' engine tests share: waiting until an engine has let go of
everything its requests held, and the devices a test runs on (a CUDA device
too where there is one, in float32 against the same CPU reference: the
sampler's noise is the same on both, so tokens must be equal)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mstar.engine.engine import Engine

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs CUDA (runs on the GPU machine)"))]


async def drained(eng: Engine) -> None:
    """Wait until no tensor, page, queued step, running row or request is left;
    fails the test after 3 s."""
    for _ in range(300):
        if (len(eng.store) == 0 and eng.store.num_owners() == 0 and eng.pages_in_use() == 0
                and not any(w.scheduler.has_work() or w.walker.runs or any(w.scheduler.running.values())
                            for w in eng.workers)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not drain: {len(eng.store)} tensors, {eng.pages_in_use()} pages held")
