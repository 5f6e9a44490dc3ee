"""Qwen3-Omni's CUDA fast path against its eager self on the GPU: the
runtime's graphs of the talker's whole frame step (its layers, the code
predictor and the draws) speak as the eager step does, in the engine, for
spoken chats and for text read aloud."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


def _tiny_with_flashinfer_heads() -> dict:
    """The tiny model with head_dim 64 where FlashInfer serves attention (its
    kernels take 64, 128 and 256): the talker's frame step then runs as the
    runtime's CUDA graphs."""
    from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_TINY

    cfg = copy.deepcopy(QWEN3_OMNI_TINY)
    for text in (cfg["thinker_config"]["text_config"], cfg["talker_config"]["text_config"]):
        text["head_dim"] = 64
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [16, 8, 8]}
    return cfg


async def _spoken(eager: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[np.ndarray], bool]:
    from mstar.config import EngineConfig
    from mstar.engine.engine import Engine
    from mstar.models import registry
    from mstar.models.qwen3_omni.model import Qwen3OmniModel
    from mstar.types import GenerateRequest, SamplingParams

    monkeypatch.setitem(registry.BUILTINS, "omni-d64", lambda name, fmt, n: Qwen3OmniModel(
        name, None, "dummy", n, builtin=_tiny_with_flashinfer_heads()))
    eng = Engine(EngineConfig(model="omni-d64", load_format="dummy", devices=("cuda:0",), dtype="bfloat16",
                              max_model_len=512, enforce_eager=eager, cuda_graph_batch_sizes=(1, 2, 4)))
    await eng.start()
    graphed = "speak" in eng.workers[0].runners["talker"].kv_graphs

    async def one(i: int) -> tuple[list[int], np.ndarray]:
        request = GenerateRequest(f"r{i}", "omni-d64", {"messages": [{"role": "user", "content": f"hello {i}"}]},
                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), walk="speak",
                                  sampling_by={"talker": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
                                                          "stop_token_ids": []},
                                               "cp": {"temperature": 0.0}})
        text, audio = [], bytearray()
        async for chunk in eng.submit(request):
            text += chunk.token_ids
            audio += chunk.audio or b""
            assert not (chunk.finished and chunk.error), chunk.error
        return text, np.frombuffer(bytes(audio), dtype=np.int16)

    async def read(i: int) -> np.ndarray:  # text to speech: `read` steps replay the graphs of `speak`
        request = GenerateRequest(f"t{i}", "omni-d64", {"text": f"read me {i}", "voice": "ethan"},
                                  SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=()),
                                  walk="tts", sampling_by={"cp": {"temperature": 0.0}})
        audio = bytearray()
        async for chunk in eng.submit(request):
            audio += chunk.audio or b""
            assert not (chunk.finished and chunk.error), chunk.error
        return np.frombuffer(bytes(audio), dtype=np.int16)

    try:
        out = await asyncio.gather(*(one(i) for i in range(3)))  # 3 rows: a bucket of 4 with a padding row
        out += [([], audio) for audio in await asyncio.gather(*(read(i) for i in range(2)))]
    finally:
        await eng.shutdown()
    return [t for t, _ in out], [a for _, a in out], graphed


async def test_the_talker_frame_step_under_graphs_speaks_as_it_does_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three spoken chats, then two texts read aloud (`tts`), each way."""
    texts, audio, graphed = await _spoken(False, monkeypatch)
    eager_texts, eager_audio, eager_graphed = await _spoken(True, monkeypatch)
    assert graphed and not eager_graphed  # the path under test
    assert texts == eager_texts
    for got, want in zip(audio, eager_audio):
        assert len(got) == len(want) == 1920 * 7 - 555
        # bf16: a replay's padded GEMMs may round differently; the first frame, before any code could differ
        first = 1920 - 555
        assert np.abs(got[:first].astype(np.int32) - want[:first]).max() <= 64, np.abs(got[:first] - want[:first]).max()
