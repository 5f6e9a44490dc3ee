"""Logprobs on a GPU: the pipelined decode group replaying CUDA graphs (and
eager steps) reports, for rows batched with rows that did not ask, the
sampled token's logprob as the top of its own list for greedy rows, the same
numbers as eager steps, and transformers' log_softmax within bf16 rounding."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams, TokenLogprob

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
transformers = pytest.importorskip("transformers")

STEPS = 24
BF16_LOGPROB_TOL = 0.15  # bf16 logits of magnitude ~10 are rounded by ~0.03; the reference rounds differently


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                                   max_position_embeddings=4096, vocab_size=1024, hidden_size=512,
                                   intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4)
    path = tmp_path_factory.mktemp("tiny_logprobs")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[1] + [rng.randrange(3, 1024) for _ in range(rng.randrange(4, 100))] for _ in range(6)]


async def _serve(folder: Path, eager: bool) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    eng = Engine(EngineConfig(model=str(folder), devices=("cuda:0",), enforce_eager=eager,
                              scheduler=SchedulerConfig(num_pages=2048)))
    await eng.start()
    assert (eng.workers[0].runners["llm"].graphs is None) == eager  # the path under test

    async def run(i: int, prompt: list[int]) -> tuple[list[int], list[TokenLogprob] | None]:
        # every other row asks, with different counts; the others must not slow or change anything
        sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=[5, None, 20][i % 3])
        toks: list[int] = []
        entries: list[TokenLogprob] = []
        async for chunk in eng.submit(GenerateRequest(f"r{i}", eng.model_name, {"prompt_ids": prompt}, sp)):
            toks.extend(chunk.token_ids)
            entries.extend(chunk.logprobs or ())
        return toks, entries if sp.logprobs is not None else None

    try:
        return await asyncio.gather(*[run(i, p) for i, p in enumerate(_prompts())])
    finally:
        await eng.shutdown()


def _reference(folder: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated], device="cuda")).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


async def test_graph_steps_report_what_eager_steps_and_the_reference_do(folder: Path) -> None:
    graphs = await _serve(folder, eager=False)
    eager = await _serve(folder, eager=True)
    assert sum(e is not None for _, e in graphs) == 4
    for prompt, (toks, entries), (toks_e, entries_e) in zip(_prompts(), graphs, eager):
        assert len(toks) == STEPS
        if entries is None:
            assert entries_e is None
            continue
        assert [e.token_id for e in entries] == toks and len(entries) == STEPS
        for e in entries:  # greedy: the sampled token is the argmax of the distribution reported
            assert e.top[0] == (e.token_id, e.logprob)
            assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        # eager steps may pick another token at a near-tie; compare up to the first difference
        same = next((j for j, (a, b) in enumerate(zip(toks, toks_e)) if a != b), STEPS)
        for e, f in zip(entries[:same], entries_e[:same]):
            assert e.logprob == pytest.approx(f.logprob, abs=1e-2)
        ref = _reference(folder, prompt, toks)
        for j, e in enumerate(entries):
            assert e.logprob == pytest.approx(ref[j, e.token_id].item(), abs=BF16_LOGPROB_TOL), j
