"""Presence and frequency penalties (OpenAI's, vLLM's): the sampler's
arithmetic, the range check, greedy tokens equal to transformers' with the
same penalties over the generated ids (rows with and without them sharing
steps), and a preempted request drawing the same tokens as one never
preempted (its counts go out and back with its row)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.sampler import SamplingTensors, output_penalties, sample
from mstar.errors import RequestError
from mstar.types import GenerateRequest, SamplingParams
from tiny_llama import save_tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 384
NEW = 24
# (presence, frequency) of each prompt's request; (0, 0) rows share the steps unpenalised
PENALTIES = [(0.0, 0.0), (1.5, 0.0), (0.0, 1.0), (0.7, 0.4), (-0.5, 0.0), (0.0, 0.0), (2.0, 2.0)]


def test_the_penalties_subtract_presence_once_and_frequency_per_count() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 1.0]])
    out = output_penalties(logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.0]))
    assert out.tolist() == [[1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.75, 4.0], [-1.0, 2.0, 3.0, 3.0]]
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.0)]
    st = SamplingTensors.build(params, [1, 2], [0, 0], "cpu")
    assert st.any_output_penalty
    # the first row's argmax (id 3, generated twice) loses 4 to id 2; the second row has no penalty
    assert sample(logits, st, outputs=torch.tensor([[0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 2.0]])).tolist() == [2, 3]
    with pytest.raises(ValueError, match="outputs"):
        sample(logits, st)
    # picking rows recomputes the flag from the host's copy
    assert not st.select(torch.tensor([1]), torch.tensor([1])).any_output_penalty


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value,ok", [(-2.0, True), (2.0, True), (0.3, True), (2.5, False), (-2.01, False),
                                      ("1", False), (True, False)])
def test_the_penalties_lie_in_minus_two_to_two(name: str, value: object, ok: bool) -> None:
    params = SamplingParams(**{name: value})
    if ok:
        params.validate()
        return
    with pytest.raises(RequestError) as info:
        params.validate()
    assert info.value.field == name


class _OutputPenalty(transformers.LogitsProcessor):
    """The penalties over the ids generated after the prompt (transformers has none of its own)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 5, 44, 12)]


def _hf_greedy(folder: Path, prompts: list[list[int]], penalties: list[tuple[float, float]]) -> list[list[int]]:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    for p, (presence, frequency) in zip(prompts, penalties):
        ids = torch.tensor([p])
        processors = transformers.LogitsProcessorList([_OutputPenalty(len(p), presence, frequency)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, logits_processor=processors)
        outs.append(out[0, len(p):].tolist())
    return outs


async def _tokens(eng: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    out: list[int] = []
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        out += chunk.token_ids
    return out


async def test_greedy_penalised_rows_match_transformers_beside_unpenalised_ones(tmp_path: Path) -> None:
    folder = save_tiny_llama(tmp_path, VOCAB)
    prompts = _prompts()
    expected = _hf_greedy(folder, prompts, PENALTIES)
    plain = _hf_greedy(folder, prompts, [(0.0, 0.0)] * len(prompts))
    # the reference is sensitive to them: most penalised prompts answer otherwise than plain greedy
    assert sum(e != p for e, p, pen in zip(expected, plain, PENALTIES) if pen != (0.0, 0.0)) >= 3
    eng = Engine(EngineConfig(model=str(folder), scheduler=SchedulerConfig(page_size=4, num_pages=512)))
    await eng.start()
    try:
        def params(i: int) -> SamplingParams:
            presence, frequency = PENALTIES[i]
            return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, presence_penalty=presence,
                                  frequency_penalty=frequency)
        first = asyncio.gather(*[_tokens(eng, f"a{i}", p, params(i)) for i, p in enumerate(prompts)])
        await asyncio.sleep(0.01)  # a second wave's prompts land between the first's decode steps
        later = asyncio.gather(*[_tokens(eng, f"b{i}", p, params(i)) for i, p in enumerate(prompts)])
        got_a, got_b = await first, await later
        for i, exp in enumerate(expected):
            assert got_a[i] == exp, f"prompt {i} {PENALTIES[i]}"
            assert got_b[i] == exp, f"prompt {i} {PENALTIES[i]} (staggered)"
        assert eng.workers[0].stats.rows > 2 * eng.workers[0].stats.steps  # rows really shared steps
    finally:
        await eng.shutdown()


async def _sampled(reservation: str, pages: int) -> tuple[list[list[int]], int]:
    """Six seeded requests with penalties (and one without), and how many preemptions their run took."""
    eng = Engine(EngineConfig(model="tiny-llama", max_model_len=128, scheduler=SchedulerConfig(
        page_size=4, num_pages=pages, kv_reservation=reservation)))
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=60, temperature=0.8, ignore_eos=True)
        runs = [_tokens(eng, f"r{i}", list(range(5 + i, 25 + i)),
                        dataclasses.replace(sp, seed=i, presence_penalty=0.3 * i - 0.5,
                                            frequency_penalty=0.4 * (i % 3)))
                for i in range(6)]
        out = await asyncio.gather(*runs)
        preemption = eng.workers[0].preemption  # none under "request": nothing is preempted there
        return list(out), preemption.preempted if preemption is not None else 0
    finally:
        await eng.shutdown()


async def test_a_preempted_penalised_request_draws_the_same_tokens() -> None:
    reserved, none = await _sampled("request", 512)
    # 32 pages hold one 128-token request: six 80-token requests take turns, swapped out and back
    lazy, preempted = await _sampled("lazy", 32)
    assert none == 0 and preempted > 0
    assert lazy == reserved
    assert all(len(t) == 60 for t in lazy)


async def test_a_row_that_stops_on_a_token_keeps_the_counts_of_what_it_drew() -> None:
    """A turn that ends on a stop token leaves its decode group with counts
    of exactly the tokens it drew: the step the group launched past the
    stop drew a dead token, which its counts leave out."""
    eng = Engine(EngineConfig(model="orpheus-tiny", max_model_len=256))
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=60, temperature=0.0, frequency_penalty=0.5, ignore_eos=True)
        prompt = eng.model.prepare(GenerateRequest("p", "orpheus-tiny", {"text": "count me", "voice": "tara"}))
        plain: list[int] = []  # the speech's LLM tokens, from the LLM's own walk
        async for chunk in eng.submit(GenerateRequest("plain", "orpheus-tiny",
                                                      {"prompt_ids": prompt.values["prompt_ids"].tolist()}, sp,
                                                      walk="generate")):
            plain += chunk.token_ids
        stop = plain[9]  # greedy: the turn below stops where this id is first drawn
        drawn = plain[:plain.index(stop) + 1]
        assert len(drawn) >= 3
        stopping = dataclasses.replace(sp, stop_token_ids=(stop,))
        stream = eng.submit(GenerateRequest("turn", "orpheus-tiny", {"text": "count me"}, stopping,
                                            more_input=True))
        async for chunk in stream:
            if chunk.awaiting_input:
                break
        run = eng.workers[0].walker.runs["turn"]
        counts = run.partitions[run.walk.root].kv_row().outputs  # the worker waits for input: nothing moves
        assert counts is not None
        expected = torch.zeros_like(counts).index_add_(0, torch.tensor(drawn), torch.ones(len(drawn)))
        assert torch.equal(counts, expected)
        eng.close_input("turn")
        async for _ in stream:
            pass
    finally:
        await eng.shutdown()
