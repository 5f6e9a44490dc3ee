"""Two GPUs in one process (runs on the GPU machine with two devices, e.g.
nvidia-h200-x2): Orpheus split across them and as replicas speaks as on one
GPU, and tensor stream items cross from one GPU to the other through the
transport, in order, with nothing left behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from fake_model import FakeModel

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.placement import parse_spec
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")

TWO = ("cuda:0", "cuda:1")
SPEECH = SamplingParams(max_tokens=70, temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=21, ignore_eos=True)


async def _speak(cfg: EngineConfig, texts: list[str]) -> list[bytes]:
    eng = Engine(cfg)
    await eng.start()
    try:
        async def one(i: int, text: str) -> bytes:
            req = GenerateRequest(f"s{i}", "orpheus-tiny", {"text": text}, SPEECH)
            return b"".join([c.audio or b"" async for c in eng.submit(req)])
        out = await asyncio.gather(*[one(i, t) for i, t in enumerate(texts)])
        for _ in range(200):
            if eng.pages_in_use() == 0 and len(eng.store) == 0 and eng.num_running() == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.pages_in_use() == 0 and len(eng.store) == 0
        assert all(w.arena is None or w.arena.blocks_in_use == 0 for w in eng.workers)
        return out
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("placement", ["split", "replicas"])
async def test_orpheus_on_two_gpus_speaks_as_on_one(placement: str) -> None:
    texts = ["hello there", "a second voice", "and a third one", "four"]
    want = await _speak(EngineConfig(model="orpheus-tiny", devices=("cuda:0",)), texts)
    got = await _speak(EngineConfig(model="orpheus-tiny", devices=TWO, placement=parse_spec(placement)), texts)
    for a, b in zip(want, got):
        x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
        assert x.size == y.size > 0
        # the same tokens; the float16 codec may batch the windows differently
        assert np.abs(x - y).max() <= 200, np.abs(x - y).max()


async def test_tensor_stream_items_cross_gpus() -> None:
    eng = Engine(EngineConfig(model="fake", devices=TWO, placement=parse_spec("counter=0,doubler=0,summer=1")),
                 model=FakeModel(max_steps=9))
    await eng.start()
    try:
        results = await asyncio.gather(*[
            asyncio.create_task(_collect(eng, f"r{i}")) for i in range(8)])
        for sums in results:
            assert sums == [(10, 4), (18, 4), (26, 4), (24, 3)]
        assert all(w.stats.steps > 0 for w in eng.workers)
        for _ in range(200):
            if len(eng.store) == 0 and not any(w.link.pending for w in eng.workers):
                break
            await asyncio.sleep(0.01)
        assert len(eng.store) == 0 and not any(w.link.pending for w in eng.workers)
    finally:
        await eng.shutdown()


async def _collect(eng: Engine, rid: str) -> list[tuple]:
    chunks = [c async for c in eng.submit(GenerateRequest(rid, "fake", {"x": 0}, SamplingParams(), walk="stream"))]
    return [tuple(c.data) for c in chunks if c.data is not None]
