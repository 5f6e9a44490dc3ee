"""The toy hybrid LLM (`toys/hybrid.py`) served on the CPU: attention over
the paged KV cache beside a recurrence whose states live in per-row slots.
Concurrent requests of different prompts and sampling decode in one group
and match the module run unbatched with a state of its own; with fewer slots
than requests, requests wait for a slot and still match; slots go back on
finish and on abort; under preemption a row's state is swapped out with its
KV and its slot serves another row meanwhile."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams, StateRows, TokenBatch
from toys.audio_decoder import VOCAB
from toys.dense import DenseAttention, draw
from toys.hybrid import ToyHybridModel
from toys.serving import DEVICES


@torch.inference_mode()
def reference(model: ToyHybridModel, ids: list[int], params: SamplingParams) -> list[int]:
    assert params.seed is not None
    spec = model.state_spec("llm")
    state = StateRows({name: torch.zeros(1, *shape, dtype=dtype) for name, shape, dtype in spec.tensors},
                      torch.tensor([0]))
    attn, n = DenseAttention(), len(ids)
    out = model.module.prefill(TokenBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), query_start=torch.tensor([0, n]),
        logits_index=torch.tensor([n - 1]), attn=attn, state=state))
    tokens = [draw(out["logits"][0], params, params.seed, 0)]
    for k in range(1, params.max_tokens):
        out = model.module.decode(TokenBatch(
            input_ids=torch.tensor([tokens[-1]]), positions=torch.tensor([n + k - 1]),
            query_start=torch.tensor([0, 1]), logits_index=torch.tensor([0]), attn=attn, state=state))
        tokens.append(draw(out["logits"][0], params, params.seed, k))
    return tokens


def _requests(seed: int, count: int, prompt: tuple[int, int] = (2, 12),
              answer: tuple[int, int] = (3, 9)) -> list[tuple[list[int], SamplingParams]]:
    """`count` prompts of lengths in `prompt`, each with its sampling and a
    token budget in `answer` (ranges end-exclusive)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(*prompt, (1,), generator=gen))
        params = SamplingParams(max_tokens=int(torch.randint(*answer, (1,), generator=gen)),
                                temperature=(0.0, 0.8, 1.2)[i % 3], seed=40 + i)
        out.append((torch.randint(0, VOCAB, (n,), generator=gen).tolist(), params))
    return out


async def _run(eng: Engine, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    chunks = [c async for c in eng.submit(GenerateRequest(rid, "toy-hybrid", {"prompt_ids": ids}, params))]
    assert chunks[-1].finish_reason == "length"
    return [t for c in chunks for t in c.token_ids]


async def _slots_back(eng: Engine, slots: int) -> None:
    """Every worker's state slots free again (`slots` each)."""
    pools = [w.scheduler.slots["llm"] for w in eng.workers]
    for _ in range(1500):
        if all(p.num_free == slots for p in pools) and eng.pages_in_use() == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{[slots - p.num_free for p in pools]} state slots still held")


@pytest.mark.parametrize("slots, devices", [(None, ("cpu",)), (2, ("cpu",)), (None, ("cpu:0", "cpu:1"))])
async def test_rows_with_state_slots_match_the_unbatched_reference(slots: int | None,
                                                                   devices: tuple[str, ...]) -> None:
    model = ToyHybridModel()
    requests = _requests(3, 6)
    expected = [reference(model, ids, params) for ids, params in requests]
    config = EngineConfig(model="toy-hybrid", devices=devices, scheduler=SchedulerConfig(state_slots=slots))
    eng = Engine(config, model=model)
    await eng.start()
    seen: list[int] = []
    decode = model.module.decode

    def spy(batch: TokenBatch) -> dict[str, torch.Tensor]:
        assert batch.state is not None
        seen.append(len(batch.state.slots))
        return decode(batch)

    model.module.decode = spy  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(_run(eng, f"h{i}", ids, p) for i, (ids, p) in enumerate(requests)))
        assert results == expected
        assert max(seen) > 1  # rows decoded together, each in its own slot
        if slots is not None:
            assert max(seen) <= slots  # no more rows run than there are slots
        await _slots_back(eng, slots or eng.config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()


async def test_an_aborted_row_gives_its_slot_back() -> None:
    model = ToyHybridModel()
    eng = Engine(EngineConfig(model="toy-hybrid", devices=("cpu",), scheduler=SchedulerConfig(state_slots=1)),
                 model=model)
    await eng.start()
    try:
        params = SamplingParams(max_tokens=100, temperature=0.0, seed=1)
        stream = eng.submit(GenerateRequest("long", "toy-hybrid", {"prompt_ids": [1, 2, 3]}, params))
        async for chunk in stream:
            if len(chunk.token_ids) and not chunk.finished:
                eng.abort("long")
            if chunk.finished:
                assert chunk.finish_reason == "abort"
        await _slots_back(eng, 1)
        # the one slot serves the next request, from an empty state
        ids, p = _requests(5, 1)[0]
        assert await _run(eng, "next", ids, p) == reference(model, ids, p)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots, pages", [(None, 10), (3, 8)])
async def test_preempted_rows_swap_their_state_out_and_back(slots: int | None, pages: int, device: str) -> None:
    """A KV pool far smaller than the requests need (`--kv-reservation lazy`):
    decode rows are swapped out and back. A swapped-out row's state goes to
    host memory and its slot back to the pool, like its pages; with fewer
    slots than requests, a waiting request takes the slot, and the swapped
    row comes back into whichever slot is free, its recurrence going on
    where it stopped."""
    model = ToyHybridModel()
    model.context = 4 * pages  # a request fits the pool alone
    # short prompts, long answers: a row swapped out has many steps left that read the state it swapped back in
    requests = _requests(1, 6, prompt=(2, 7), answer=(14, 22))
    expected = [reference(model, ids, params) for ids, params in requests]
    config = EngineConfig(model="toy-hybrid", devices=(device,), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=pages, kv_reservation="lazy", state_slots=slots))
    eng = Engine(config, model=model)
    await eng.start()
    pool = eng.workers[0].runners["llm"].state
    swaps = {"out": 0, "in": 0}
    swap_out, swap_in = pool.swap_out, pool.swap_in

    def counted_out(slot: int) -> dict[str, torch.Tensor]:
        swaps["out"] += 1
        return swap_out(slot)

    def counted_in(saved: dict[str, torch.Tensor], slot: int) -> None:
        swaps["in"] += 1
        swap_in(saved, slot)

    pool.swap_out, pool.swap_in = counted_out, counted_in
    try:
        results = await asyncio.gather(*(_run(eng, f"p{i}", ids, p) for i, (ids, p) in enumerate(requests)))
        assert results == expected
        assert eng.workers[0].preemption.preempted > 0
        assert swaps["out"] == eng.workers[0].preemption.preempted  # every preempted row had a slot
        assert swaps["in"] == eng.workers[0].preemption.resumed > 0
        await _slots_back(eng, slots or config.scheduler.max_num_seqs)
    finally:
        await eng.shutdown()
