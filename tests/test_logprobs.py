"""Logprobs of sampled tokens against a direct computation: the sampler's
packing of the rows that asked, and a served Llama whose reported logprobs
equal log_softmax of transformers' logits for the same sequence (the raw
distribution, whatever the row's sampling), alone and batched with rows that
did not ask."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from tiny_llama import save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.sampler import SamplingTensors, sample, token_logprobs
from mstar.errors import RequestError
from mstar.types import MAX_LOGPROBS, GenerateRequest, SamplingParams, TokenLogprob

transformers = pytest.importorskip("transformers")

VOCAB = 384
PROMPTS = [[1, 17, 99, 250, 3], [1, 200, 201, 202, 203, 204, 205, 206, 207, 40, 41], [1, 5]]


def test_only_the_rows_that_asked_are_computed() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, repetition_penalty=1.5), SamplingParams(temperature=0.9, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS)]
    st = SamplingTensors.build(params, [1, 2, 3, 4, 5], [0] * 5, "cpu")
    seen = torch.zeros(5, 50, dtype=torch.bool)
    seen[:, :10] = True
    tokens = sample(logits, st, seen)
    packed = token_logprobs(logits, tokens, st)
    assert packed is not None and packed.shape == (5, 1 + 2 * MAX_LOGPROBS)
    assert packed[[0, 2]].isnan().all()
    raw = torch.log_softmax(logits, dim=-1)  # before the penalty and the temperature
    for row in (1, 3, 4):
        assert packed[row, 0].item() == pytest.approx(raw[row, tokens[row]].item(), abs=1e-6)
        k = int(st.logprobs[row])
        top = raw[row].topk(k)
        assert torch.allclose(packed[row, 1:1 + k].float(), top.values)
        assert packed[row, 1 + MAX_LOGPROBS:1 + MAX_LOGPROBS + k].long().tolist() == top.indices.tolist()
    assert token_logprobs(logits, tokens, SamplingTensors.build(params[:1] * 5, [0] * 5, [0] * 5, "cpu")) is None


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_logprobs_bounds(bad: object) -> None:
    with pytest.raises(RequestError) as caught:
        SamplingParams(logprobs=bad).validate()  # type: ignore[arg-type]
    assert caught.value.field == "logprobs"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_logprobs"), VOCAB, layers=2, max_positions=256)


def _reference(folder: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated token's position: [len(generated), V]."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


async def _run(eng: Engine, rid: str, prompt: list[int],
               sp: SamplingParams) -> tuple[list[int], list[TokenLogprob] | None]:
    toks: list[int] = []
    entries: list[TokenLogprob] = []
    asked = False
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        toks.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            asked = True
            entries.extend(chunk.logprobs)
        else:
            assert not chunk.token_ids or sp.logprobs is None, chunk
    return toks, entries if asked else None


def _check_against(ref: torch.Tensor, toks: list[int], entries: list[TokenLogprob], k: int, greedy: bool) -> None:
    assert [e.token_id for e in entries] == toks
    for j, (tok, e) in enumerate(zip(toks, entries)):
        assert e.logprob == pytest.approx(ref[j, tok].item(), abs=1e-4), j
        top = ref[j].topk(k)
        assert [t for t, _ in e.top] == top.indices.tolist(), j
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
        if greedy and k:
            assert e.top[0] == (tok, e.logprob)


@pytest.fixture
async def eng(hf_folder: Path):
    e = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(page_size=4, num_pages=256)))
    await e.start()
    try:
        yield e
    finally:
        await e.shutdown()


async def test_greedy_logprobs_equal_log_softmax_of_the_reference(hf_folder: Path, eng: Engine) -> None:
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(PROMPTS):
        toks, entries = await _run(eng, f"g{i}", prompt, sp)
        assert entries is not None and len(toks) == 8
        _check_against(_reference(hf_folder, prompt, toks), toks, entries, 5, greedy=True)


async def test_batched_with_rows_that_did_not_ask_equals_alone(hf_folder: Path, eng: Engine) -> None:
    asking = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=k) for k in (0, 3, MAX_LOGPROBS)]
    # a drawn row reports the raw distribution too, not the penalised, tempered and filtered one
    drawn = SamplingParams(max_tokens=9, temperature=0.8, top_k=20, repetition_penalty=1.3, seed=7, ignore_eos=True,
                           logprobs=4)
    alone = [await _run(eng, f"alone{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, asking))]
    alone.append(await _run(eng, "alone-drawn", PROMPTS[0], drawn))
    quiet = [SamplingParams(max_tokens=n, temperature=t, seed=3, ignore_eos=True) for n, t in ((3, 0.0), (5, 1.0))]
    steps, rows = eng.workers[0].stats.steps, eng.workers[0].stats.rows
    runs = [_run(eng, f"b{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, asking))]
    runs.append(_run(eng, "b-drawn", PROMPTS[0], drawn))
    runs += [_run(eng, f"q{i}", PROMPTS[1], sp) for i, sp in enumerate(quiet)]
    together = await asyncio.gather(*runs)
    assert eng.workers[0].stats.rows - rows > 2 * (eng.workers[0].stats.steps - steps)  # they shared steps
    for (toks, entries), (toks_alone, entries_alone) in zip(together, alone):
        assert toks == toks_alone
        assert entries is not None and entries_alone is not None
        for e, a in zip(entries, entries_alone, strict=True):
            assert e.token_id == a.token_id and [t for t, _ in e.top] == [t for t, _ in a.top]
            assert e.logprob == pytest.approx(a.logprob, abs=1e-5)
            assert [v for _, v in e.top] == pytest.approx([v for _, v in a.top], abs=1e-5)
    assert all(entries is None for _, entries in together[len(alone):])
    for (toks, entries), prompt, sp in zip(together, PROMPTS + [PROMPTS[0]], asking + [drawn]):
        assert entries is not None and all(not math.isnan(e.logprob) for e in entries)
        _check_against(_reference(hf_folder, prompt, toks), toks, entries, sp.logprobs or 0,
                       greedy=sp.temperature == 0)
