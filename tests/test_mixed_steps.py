"""Mixed steps: new rows' prompt tokens ride in a running decode group's step
(one forward over ragged rows) instead of a prefill step of their own. The
scheduler's choice of what rides along, and outputs equal to unmixed steps
(greedy, seeded, with a repetition penalty, with logprobs, chunked, cached)."""

from __future__ import annotations

import dataclasses

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tiny_llama import save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.execution.runner import ComponentRunner
from mstar.graph import Component
from standing_group import FakeGroup
from mstar.scheduler import ModeCaps, PagePool, Scheduler, WorkItem
from mstar.scheduler.group_steps import MIXED_MIN_CHUNK, MIXED_ROWS
from mstar.types import GenerateRequest, SamplingParams

pytest.importorskip("transformers")

VOCAB = 384
DECODE = ("llm", "decode")


def _sched(max_tokens: int = 32, mix: bool = True, mixes: bool = True, rows: int = 3) -> tuple[Scheduler, PagePool]:
    pool = PagePool(64, 4)
    caps = {("llm", "prefill"): ModeCaps(8, max_tokens), DECODE: ModeCaps(8, max_tokens)}
    sched = Scheduler(caps, {"llm": pool}, mix={"llm": frozenset({"prefill", "decode"})} if mix else None)
    sched.add_group(DECODE, FakeGroup(rows, mixes))
    return sched, pool


def _prompt(rid: str, n: int, pool: PagePool, chunkable: bool = True) -> WorkItem:
    return WorkItem(rid, "main", "llm", "prefill", num_tokens=n, pages_needed=pool.pages_for(n), starts_row=True,
                    chunkable=chunkable)


def test_a_group_step_takes_waiting_prompts_in_the_room_its_rows_leave() -> None:
    sched, pool = _sched(32)
    first = sched.schedule()  # the group's ticket is older than any prompt's
    assert first.group is not None and first.items == []
    a, b = _prompt("a", 20, pool), _prompt("b", 30, pool)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.group is not None and plan.rows == slice(0, 3)
    assert plan.items == [a, b] and (a.chunk, b.chunk) == (20, 9)  # 32 tokens: 3 rows, 20, the 9 left
    assert b.partial and len(a.granted) == 5 and len(b.granted) == 8
    assert sched.running["llm"] == 2


def test_prompts_ride_along_only_where_they_and_the_group_may() -> None:
    for kwargs in ({"mix": False}, {"mixes": False}):
        sched, pool = _sched(**kwargs)
        sched.schedule()
        sched.add(_prompt("a", 5, pool))
        plan = sched.schedule()
        assert plan.group is not None and plan.items == []  # the prompt waits for a step of its own
        assert sched.schedule().items[0].request_id == "a"
    sched, pool = _sched()
    sched.schedule()
    sched.add(_prompt("rigid", 5, pool, chunkable=False))  # a signed mode's prompt runs whole, on its own
    assert sched.schedule().items == []
    sched, pool = _sched(max_tokens=3, rows=3)  # no room beside the rows
    sched.schedule()
    sched.add(_prompt("a", 5, pool))
    assert sched.schedule().items == []
    sched, pool = _sched(max_tokens=40, rows=3)  # a long prompt would creep along in chunks of 37
    assert 40 - 3 < MIXED_MIN_CHUNK
    sched.schedule()
    sched.add(_prompt("long", 200, pool))
    assert sched.schedule().items == [] and sched.schedule().items[0].request_id == "long"


def test_mix_tokens_caps_what_a_mixed_step_takes_and_the_rest_rides_later() -> None:
    pool = PagePool(128, 4)
    caps = {("llm", "prefill"): ModeCaps(8, 1024), DECODE: ModeCaps(8, 1024)}
    sched = Scheduler(caps, {"llm": pool}, mix={"llm": frozenset({"prefill", "decode"})}, mix_tokens={"llm": 100})
    sched.add_group(DECODE, FakeGroup(3, mixes=True))
    sched.schedule()
    long = _prompt("long", 250, pool)
    sched.add(long)
    chunks = []
    while True:
        plan = sched.schedule()
        assert plan.group is not None and plan.items == [long]
        chunks.append(long.chunk)
        if not long.partial:
            break
        long.granted = []
        sched.next_chunk(long)
    assert chunks == [100, 100, 50]


def test_a_mixed_step_takes_at_most_MIXED_ROWS_new_rows() -> None:
    sched, pool = _sched(1024)
    sched.schedule()
    for i in range(MIXED_ROWS + 2):
        sched.add(_prompt(f"p{i}", 3, pool))
    assert len(sched.schedule().items) == MIXED_ROWS


def test_a_component_may_keep_modes_apart() -> None:
    assert Component(("prefill", "decode"), kv_cache=True, samples=True, apart=("prefill",)).apart == ("prefill",)
    with pytest.raises(ValueError, match="apart"):
        Component(("prefill", "decode"), apart=("score",))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_mixed"), VOCAB)


PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=12, temperature=0.9, seed=3, repetition_penalty=1.3, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(40)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 60)] + [[1, 7]]


async def _run(eng: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], list[float]]:
    toks, lps = [], []
    async for chunk in eng.submit(GenerateRequest(rid, eng.model_name, {"prompt_ids": prompt}, sp)):
        assert chunk.error is None, chunk.error
        toks.extend(chunk.token_ids)
        lps.extend(lp.logprob for lp in chunk.logprobs or [])
    return toks, lps


async def _outputs(folder: Path, mixed: bool, budget: int, caching: bool, device: str
                   ) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Outputs of requests that arrive one after another while a long one
    decodes, and how many steps carried new rows."""
    mixed_steps = 0
    run_group = ComponentRunner.run_group

    def counting(self, group, sl, fed=None, new=None):
        nonlocal mixed_steps
        mixed_steps += new is not None
        return run_group(self, group, sl, fed, new)

    eng = Engine(EngineConfig(model=str(folder), devices=(device,), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=512, max_num_batched_tokens=budget, prefix_caching=caching, mixed_steps=mixed)))
    await eng.start()
    try:
        ComponentRunner.run_group = counting
        running = asyncio.ensure_future(_run(eng, "running", [1, 5, 9], SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True)))
        tasks = []
        for i, prompt in enumerate(_prompts()):
            for j, sp in enumerate(PARAMS):
                await asyncio.sleep(0.005)
                tasks.append(asyncio.ensure_future(_run(eng, f"r{i}{j}", prompt, sp)))
        outs = await asyncio.gather(*tasks)
        stats = eng.workers[0].stats
        assert stats.mixed_steps == mixed_steps and stats.mixed_graph_steps == 0  # no graphs here
        assert stats.mixed_rows >= mixed_steps
        return [await running, *outs], mixed_steps
    finally:
        ComponentRunner.run_group = run_group
        await eng.shutdown()


def _same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, abs=1e-4)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
async def test_outputs_are_the_same_mixed_or_not(hf_folder: Path, device: str) -> None:
    alone, none = await _outputs(hf_folder, False, 8192, False, device)
    assert none == 0
    mixed, steps = await _outputs(hf_folder, True, 8192, False, device)
    assert steps > 0
    _same(mixed, alone)
    chunked, steps = await _outputs(hf_folder, True, 90, True, device)  # chunks of a prompt in several steps
    assert steps > 0
    _same(chunked, alone)


async def test_no_pages_leak_from_mixed_steps_with_aborts(hf_folder: Path) -> None:
    eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(
        page_size=4, num_pages=512, max_num_batched_tokens=32, prefix_caching=False)))
    await eng.start()
    try:
        running = asyncio.ensure_future(_run(eng, "running", [1, 5, 9], SamplingParams(
            max_tokens=300, ignore_eos=True)))
        tasks = []
        for i, prompt in enumerate(_prompts() * 2):
            await asyncio.sleep(0.003)
            tasks.append(asyncio.ensure_future(_run(eng, f"r{i}", prompt, SamplingParams(
                max_tokens=20, ignore_eos=True))))
            if i % 3 == 1:
                await asyncio.sleep(0.002)
                eng.abort(f"r{i}")
        await asyncio.gather(*tasks, return_exceptions=True)
        eng.abort("running")
        await asyncio.gather(running, return_exceptions=True)
        for _ in range(3000):
            if eng.pages_in_use() == 0 and len(eng.store) == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.pages_in_use() == 0 and len(eng.store) == 0
    finally:
        await eng.shutdown()


def test_a_step_that_preempts_its_rows_admits_no_new_ones() -> None:
    pool = PagePool(8, 4)
    held = pool.allocate(6)  # three rows of two pages each, all needing another: the youngest goes
    caps = {("llm", "prefill"): ModeCaps(8, 64), DECODE: ModeCaps(8, 64)}
    sched = Scheduler(caps, {"llm": pool}, grow_pages=True, mix={"llm": frozenset({"prefill", "decode"})})

    class Short(FakeGroup):
        def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
            return list(range(self.rows))

        def pages(self, row: int) -> list[int]:
            return held[2 * row:2 * row + 2]
    sched.add_group(DECODE, Short(3, mixes=True))
    sched.running["llm"] = 3
    sched.add(_prompt("new", 3, pool))
    sched._groups[0].group.ticket = -2  # the group's turn first
    plan = sched.schedule()
    assert plan.group is not None and plan.preempt == [2] and plan.items == []
    assert pool.num_free == 2  # what the new row would have taken


async def test_a_failing_mixed_step_runs_its_new_rows_alone_and_the_group_steps_on(
        hf_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step that raises leaves the group's rows as they were: they
    step on alone, and the new row runs on its own after it (a row whose
    input breaks that step too fails alone), drawing what it draws alone."""
    import mstar.engine.execution.group_steps as group_steps_module

    eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(page_size=4, num_pages=256)))
    await eng.start()
    try:
        request = GenerateRequest("new", eng.model_name, {"prompt_ids": [1, 7, 8, 9]},
                                  SamplingParams(max_tokens=4, temperature=0.0))
        alone = [t for c in [c async for c in eng.submit(request)] for t in c.token_ids]

        def broken(*args, **kwargs):
            raise ValueError("a new row's table is broken")
        monkeypatch.setattr(group_steps_module, "mixed_inputs", broken)
        running = aiter(eng.submit(GenerateRequest("running", eng.model_name, {"prompt_ids": [1, 5, 9]},
                                                   SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))))
        tokens = list((await anext(running)).token_ids)  # its first token: it decodes in its group now
        # the worker takes the new row in within a step or two, of the 299 the running row has left: into a group step
        chunks = [c async for c in eng.submit(dataclasses.replace(request, request_id="new2"))]
        assert chunks[-1].error is None and [t for c in chunks for t in c.token_ids] == alone
        async for chunk in running:  # the running row stepped on, alone
            assert chunk.error is None, chunk.error
            tokens += chunk.token_ids
        assert len(tokens) == 300
        assert eng.workers[0].stats.failed_steps == 1  # the mixed one
    finally:
        await eng.shutdown()


async def test_decode_rows_of_two_walks_share_one_group_and_its_steps() -> None:
    """Orpheus's `speak` and `generate` walks both loop on the Llama's decode:
    their rows step together, each row's tokens going where its own walk
    sends them (audio through the codec, token ids to the client), as they
    do when each request runs alone."""
    eng = Engine(EngineConfig(model="orpheus-tiny", scheduler=SchedulerConfig(page_size=4)))
    await eng.start()
    shared = []

    def hook(report) -> None:
        groups = list(eng.workers[0].walker.groups.values())
        if report.mode == "decode" and groups:
            shared.append(max(len(g) for g in groups))
    eng.add_report_hook(hook)
    speak = GenerateRequest("speak", eng.model_name, {"text": "hello there", "voice": None},
                            SamplingParams(max_tokens=70, temperature=0.6, seed=2, ignore_eos=True))
    text = GenerateRequest("text", eng.model_name, {"prompt_ids": [1, 5, 9, 13]},
                           SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), walk="generate")

    async def run(request: GenerateRequest) -> tuple[list[int], bytes]:
        chunks = [c async for c in eng.submit(request)]
        assert chunks[-1].error is None
        return [t for c in chunks for t in c.token_ids], b"".join(c.audio or b"" for c in chunks)
    try:
        alone = [await run(speak), await run(text)]
        assert alone[0][1] and not alone[1][1] and len(alone[1][0]) == 30
        shared.clear()
        together = await asyncio.gather(run(speak), run(text))
        assert len(eng.workers[0].walker.groups) == 1 and max(shared) == 2
        assert list(together) == alone
    finally:
        await eng.shutdown()


def test_a_step_of_prompts_alone_packs_as_a_mixed_step_without_group_rows() -> None:
    """`prompt_inputs` (a lone short prompt's step, replayed in a mixed graph
    on CUDA) lays the new rows out as `mixed_inputs` does after a group's."""
    from types import SimpleNamespace
    from mstar.engine.execution.mixed import NewRows, mixed_inputs, prompt_inputs
    kv = [SimpleNamespace(kv_len=4, start=4, pages=[7, 3], slot=None),
          SimpleNamespace(kv_len=0, start=0, pages=[5], slot=None)]
    prompts = [torch.arange(10, 19), torch.arange(20, 23)]
    new = NewRows([None, None], kv, prompts, [(4, 7), (0, 3)], [(), ()])   # a chunk, then a whole prompt
    alone = prompt_inputs(new, torch.device("cpu"))
    group = SimpleNamespace(tokens=torch.tensor([1, 2]), kv_lens=torch.tensor([9, 30]),
                            block_table=torch.tensor([[1, 2, 4], [6, 8, 9]]), slots=torch.tensor([-1, -1]),
                            positions=lambda sl: torch.tensor([9, 30])[sl])
    beside = mixed_inputs(group, slice(0, 2), new)
    assert alone.group_tokens.numel() == 0 and alone.rows == 2
    assert alone.new_ids.tolist() == [14, 15, 16, 20, 21, 22] == beside.new_ids.tolist()
    assert alone.positions.tolist() == [4, 5, 6, 0, 1, 2] == beside.positions[2:].tolist()
    assert alone.query_start.tolist() == [0, 3, 6] == (beside.query_start[2:] - 2).tolist()
    assert alone.context_lens.tolist() == [4, 0]
    assert alone.block_tables.tolist() == [[7, 3], [5, 0]]
    assert alone.ends == [1] and alone.logits_index.tolist() == [5] == (beside.logits_index[2:] - 2).tolist()
    assert alone.slots.tolist() == [-1, -1] and beside.slots.tolist() == [-1] * 4
