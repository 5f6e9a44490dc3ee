"""Qwen3.5 on the GPU (the device machine: scripts/gpu_check.sh tests).

Decode steps of rows with per-row state replay CUDA graphs, the rows'
slots copied into the graph's static slots (padding rows on the scratch
slot): greedy tokens equal to the same engine run eagerly, in bfloat16 over
FlashInfer; and in float32 equal to transformers' own `Qwen3_5ForCausalLM`.
Chats with images (the vision tower, `prefill_image`, decode past the rope
delta) likewise: float32 tokens equal to transformers'
`Qwen3_5ForConditionalGeneration`, bfloat16 decode graphs (3-axis positions
beside the state slots) equal to eager.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from tiny_llama import generated
from tiny_qwen35 import save_tiny_qwen35

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (runs on the GPU machine)", allow_module_level=True)

from mstar.config import EngineConfig, SchedulerConfig  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs  # noqa: E402
from mstar.types import SamplingParams  # noqa: E402

transformers = pytest.importorskip("transformers")
PROMPTS = [[1, 5, 9, 33, 7], [1, *range(40, 140)], [1, 2], [1, *range(300, 330)], [1, 17, 17, 17]]
NEW = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen35(tmp_path_factory.mktemp("qwen35_gpu"), head_dim=64)


async def _tokens(folder: Path, dtype: str, eager: bool) -> tuple[list[list[int]], int]:
    replays = 0
    run = DecodeGraphs.run

    def counted(self, *args, **kwargs):
        nonlocal replays
        out = run(self, *args, **kwargs)
        replays += out is not None
        return out
    DecodeGraphs.run = counted
    eng = Engine(EngineConfig(model=str(folder), devices=("cuda:0",), dtype=dtype, enforce_eager=eager,
                              cuda_graph_batch_sizes=(1, 2, 4, 8), scheduler=SchedulerConfig(page_size=16)))
    await eng.start()
    try:
        greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        return list(await asyncio.gather(*(generated(eng, f"r{i}", p, greedy) for i, p in enumerate(PROMPTS)))), replays
    finally:
        DecodeGraphs.run = run
        await eng.shutdown()


async def test_decode_graphs_of_rows_with_state_give_the_eager_tokens(folder: Path) -> None:
    eager, none = await _tokens(folder, "bfloat16", True)
    graphed, replays = await _tokens(folder, "bfloat16", False)
    assert none == 0 and replays > 0
    assert graphed == eager


async def test_float32_on_the_gpu_matches_transformers(folder: Path) -> None:
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device="cuda")
            want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                    do_sample=False)[0, len(p):].tolist())
    got, _ = await _tokens(folder, "float32", False)
    assert got == want


async def _chat_tokens(folder: Path, dtype: str, eager: bool) -> list[list[int]]:
    from test_qwen35_vision import CHATS, _answers
    eng = Engine(EngineConfig(model=str(folder), devices=("cuda:0",), dtype=dtype, enforce_eager=eager,
                              cuda_graph_batch_sizes=(1, 2, 4, 8), scheduler=SchedulerConfig(page_size=16)))
    await eng.start()
    try:
        return await _answers(eng, CHATS)
    finally:
        await eng.shutdown()


async def test_chats_with_images_on_the_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_qwen35_vision import CHATS, Reference
    reference = Reference(tmp_path_factory.mktemp("qwen35_vl_gpu"), experts=0, head_dim=64)
    want = [reference.answer(messages) for messages in CHATS]   # transformers on the CPU, float32
    assert await _chat_tokens(reference.folder, "float32", False) == want
    assert await _chat_tokens(reference.folder, "bfloat16", False) == \
        await _chat_tokens(reference.folder, "bfloat16", True)
