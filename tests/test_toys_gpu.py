"""The toy models' runtime paths on a CUDA device, in float32, against the
same unbatched CPU references as their CPU tests: the code predictor nested
in a talker (decode groups keeping hidden states, CUDA graphs), guidance over
a forked cache under preemption (page copies, non-causal read steps, swaps
through pinned memory), and the hybrid's state slots swapped out and back.
Sampling noise is a function of (seed, counter, index), the same on both
devices, so tokens must be equal; floats within the CPU tests' tolerance."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import SamplingParams
from test_toy_hybrid import _long_requests, _run
from test_toy_hybrid import reference as hybrid_reference
from test_toy_image import CFG_CASES, HIDDEN, PREEMPT_CONTEXT, PREEMPT_PAGES, TOL, VOCAB, _guided, cfg_reference
from test_toy_omni import _check, _requests, _serve, frames_reference
from toys.hybrid import ToyHybridModel
from toys.image_gen import ToyImageModel
from toys.omni import ToyOmniModel
from toys.serving import drained

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


async def test_code_predictor_frames_on_cuda_match_the_cpu_reference() -> None:
    model = ToyOmniModel()
    cps = [SamplingParams(temperature=t, top_k=k) for t, k in ((0.9, 6), (0.0, 1), (1.3, 12), (0.7, 3), (1.0, 0),
                                                               (0.5, 4))]
    seeded = [(ids, mel, think, talk, dataclasses.replace(cp, seed=None)) for (ids, mel, think, talk), cp
              in zip(_requests(5), cps)]
    expected = [frames_reference(model, *r) for r in seeded]
    eng = Engine(EngineConfig(model="toy-omni", devices=("cuda:0",), dtype="float32"), model=model)
    await eng.start()
    try:
        results = await asyncio.gather(*(_serve(eng, f"f{k}", [(ids, mel)], think, talk, cp, walk="chat_frames")
                                         for k, (ids, mel, think, talk, cp) in enumerate(seeded)))
        for got, want in zip(results, expected):
            _check(got, [want])
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_guidance_under_preemption_on_cuda_matches_three_contexts() -> None:
    model = ToyImageModel()
    model.context = PREEMPT_CONTEXT
    gen = torch.Generator().manual_seed(8)
    requests = [(torch.randint(0, VOCAB, (ni,), generator=gen).tolist(),
                 torch.randint(0, VOCAB, (nt,), generator=gen).tolist(),
                 torch.randn(rows, HIDDEN, generator=gen), steps, scale)
                for ni, nt, rows, steps, scale in CFG_CASES * 2]
    expected = [cfg_reference(model, *r) for r in requests]
    eng = Engine(EngineConfig(model="toy-image", devices=("cuda:0",), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=PREEMPT_PAGES, kv_reservation="lazy")), model=model)
    await eng.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_guided(eng, f"p{k}", *r) for k, r in enumerate(requests))),
                                         120)
        for (images, reason), want in zip(results, expected):
            assert reason == "length" and len(images) == 1
            torch.testing.assert_close(torch.tensor(images[0]), want, atol=TOL, rtol=0)
        assert eng.workers[0].preemption.preempted > 0
        await drained(eng)
    finally:
        await eng.shutdown()


async def test_state_slots_swapped_under_preemption_on_cuda() -> None:
    model = ToyHybridModel()
    model.context = 32
    requests = _long_requests(1, 6)
    expected = [hybrid_reference(model, ids, params) for ids, params in requests]
    eng = Engine(EngineConfig(model="toy-hybrid", devices=("cuda:0",), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=8, kv_reservation="lazy", state_slots=3)), model=model)
    await eng.start()
    try:
        results = await asyncio.gather(*(_run(eng, f"s{i}", ids, p) for i, (ids, p) in enumerate(requests)))
        assert results == expected
        assert eng.workers[0].preemption.resumed > 0
    finally:
        await eng.shutdown()
