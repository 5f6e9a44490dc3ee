"""Chunked prefill: a prompt longer than a step's token cap (or than the room
other rows leave) runs over several steps, each behind the running rows'
steps, with the same outputs as in one step, its prefix cached or not."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tiny_llama import generated, save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.scheduler import ModeCaps, PagePool, Scheduler, WorkItem
from mstar.types import GenerateRequest, SamplingParams

pytest.importorskip("transformers")

VOCAB = 384


def _sched(max_tokens: int) -> tuple[Scheduler, PagePool]:
    pool = PagePool(64, 4)
    caps = {("llm", "prefill"): ModeCaps(8, max_tokens), ("llm", "decode"): ModeCaps(8, max_tokens)}
    return Scheduler(caps, {"llm": pool}), pool


def _prompt(rid: str, n: int, pool: PagePool, chunkable: bool = True) -> WorkItem:
    return WorkItem(rid, "main", "llm", "prefill", num_tokens=n, pages_needed=pool.pages_for(n), starts_row=True,
                    chunkable=chunkable)


def test_a_long_prompt_takes_the_cap_a_step_and_waits_behind_running_rows_between_chunks() -> None:
    sched, pool = _sched(32)
    long = _prompt("long", 100, pool)
    sched.add(long)
    plan = sched.schedule()
    assert plan.items == [long] and long.chunk == 32 and long.partial and len(long.granted) == 25
    long.granted = []
    decode = WorkItem("run", "main", "llm", "decode")  # a running row's next step, queued meanwhile
    sched.add(decode)
    chunks = [long.chunk]
    sched.next_chunk(long)
    assert sched.schedule().items == [decode]  # it queued before the rest of the prompt
    while True:
        plan = sched.schedule()
        assert plan.items == [long]
        chunks.append(long.chunk)
        if not long.partial:
            break
        sched.next_chunk(long)
    assert chunks == [32, 32, 32, 4] and long.done == 96 and sched.running["llm"] == 1


def test_a_chunkable_prompt_fills_the_room_other_prompts_leave() -> None:
    sched, pool = _sched(32)
    short, rigid, long = _prompt("a", 20, pool), _prompt("b", 20, pool, chunkable=False), _prompt("c", 50, pool)
    for item in (short, long):
        sched.add(item)
    assert sched.schedule().items == [short, long] and (short.chunk, long.chunk) == (20, 12)
    sched2, pool2 = _sched(32)
    sched2.add(_prompt("a", 20, pool2))
    sched2.add(rigid)  # a prompt that cannot be split waits for a step of its own
    assert len(sched2.schedule().items) == 1 and sched2.schedule().items == [rigid]


def test_a_prompt_between_chunks_passes_a_new_one_waiting_for_pages() -> None:
    """A prompt halfway through its chunks holds its pages; a new prompt at
    the front of the line waits for pages. The held prompt goes on past it
    (it frees pages as it ends), and other new prompts stay behind it. Stopped
    at that front, every request waited, while under lazy reservation the
    running rows preempted one another for pages without end."""
    pool = PagePool(30, 4)
    caps = {("llm", "prefill"): ModeCaps(8, 32), ("llm", "decode"): ModeCaps(8, 32)}
    sched = Scheduler(caps, {"llm": pool})
    long = _prompt("long", 100, pool)
    sched.add(long)
    assert sched.schedule().items == [long] and pool.num_free == 5
    long.granted = []
    big, small = _prompt("big", 40, pool), _prompt("small", 4, pool)   # 10 pages: more than are free
    sched.add(big)
    sched.next_chunk(long)
    sched.add(small)
    assert sched.schedule().items == [long] and long.done == 32   # not `small`: it came after `big`
    assert [i.request_id for i in sched.waiting("llm")] == ["big", "small"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_chunks"), VOCAB)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(50)]
    return [shared, shared + [rng.randrange(3, VOCAB) for _ in range(9)],
            [1] + [rng.randrange(3, VOCAB) for _ in range(77)], [1, 5, 9]]


async def _outputs(folder: Path, budget: int, caching: bool, device: str) -> list[list[int]]:
    eng = Engine(EngineConfig(model=str(folder), devices=(device,), dtype="float32", scheduler=SchedulerConfig(
        page_size=4, num_pages=256, max_num_batched_tokens=budget, prefix_caching=caching)))
    await eng.start()
    try:
        params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=10, temperature=0.9, seed=3, repetition_penalty=1.2, ignore_eos=True)]
        first = await generated(eng, "first", _prompts()[0], params[0])
        rest = await asyncio.gather(*[generated(eng, f"r{i}{j}", p, sp) for i, p in enumerate(_prompts())
                                      for j, sp in enumerate(params)])
        return [first, *rest]
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
async def test_outputs_are_the_same_in_chunks_or_whole_cached_or_not(hf_folder: Path, device: str) -> None:
    whole = await _outputs(hf_folder, 8192, False, device)
    assert await _outputs(hf_folder, 16, False, device) == whole
    assert await _outputs(hf_folder, 16, True, device) == whole
    assert await _outputs(hf_folder, 7, True, device) == whole


@pytest.mark.parametrize(("mixed", "budget"), [(False, 24), (True, 24), (True, 80)])
async def test_running_rows_step_between_a_long_prompts_chunks(hf_folder: Path, mixed: bool, budget: int) -> None:
    """In steps of their own (also when mixed steps would leave its chunks
    too small), or inside the running row's steps: each of those then carries
    a chunk as large as the step's cap leaves room for."""
    eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(
        page_size=4, num_pages=256, max_num_batched_tokens=budget, mixed_steps=mixed)))
    await eng.start()
    steps: list[str] = []
    eng.add_report_hook(lambda r: steps.append(r.mode) if r.rows > 0 and r.component else None)
    try:
        running = asyncio.ensure_future(generated(eng, "running", [1, 5, 9], SamplingParams(max_tokens=400,
                                                                                     ignore_eos=True)))
        while len(steps) < 3:
            await asyncio.sleep(0.001)
        start = len(steps)
        long = [1] + [random.Random(2).randrange(3, VOCAB) for _ in range(200)]
        await generated(eng, "long", long, SamplingParams(max_tokens=2, ignore_eos=True))
        seen = steps[start:]
        if budget == 80:  # every chunk rode in a decode step of the running row: 79 tokens beside its one
            assert "prefill" not in seen
            assert eng.workers[0].stats.mixed_steps >= -(-201 // 79)
        else:
            prefills = [i for i, step in enumerate(seen) if step == "prefill"]
            assert len(prefills) >= 201 // 24  # one step per chunk at least
            between = seen[prefills[0]:prefills[-1]]
            assert between.count("decode") >= len(prefills) - 1  # the running row stepped between the chunks
        assert not running.done()
        eng.abort("running")
        await running
    finally:
        await eng.shutdown()


async def test_a_prompt_aborted_between_chunks_releases_nothing_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first chunk's step took its inputs out of the store; the queued rest
    holds them itself, so cancelling it releases no reference again."""
    from mstar.engine.worker.walker import Walker

    cancelled: list[tuple[bool, dict]] = []
    cancel, next_chunk = Walker.cancel, Scheduler.next_chunk

    def spy(self: Walker, items: list) -> None:
        cancelled.extend((item.payload.held is not None, dict(item.payload.inputs)) for item in items)
        cancel(self, items)

    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=8)))
    chunks_run = 0

    def abort_at_the_third(self: Scheduler, item: WorkItem) -> None:  # on the worker thread, as its inbox would
        nonlocal chunks_run
        next_chunk(self, item)
        chunks_run += 1
        if chunks_run == 3:
            eng.workers[0].walker.abort(item.request_id)

    monkeypatch.setattr(Walker, "cancel", spy)
    monkeypatch.setattr(Scheduler, "next_chunk", abort_at_the_third)
    await eng.start()
    try:
        prompt = [random.Random(2).randrange(3, 250) for _ in range(200)]
        request = GenerateRequest("long", eng.model_name, {"prompt_ids": prompt},
                                  SamplingParams(max_tokens=2, ignore_eos=True))
        chunks = [c async for c in eng.submit(request)]
        assert chunks[-1].finish_reason == "abort" and chunks_run == 3
        assert [held for held, _ in cancelled] == [True] and cancelled[0][1] == {}
        for _ in range(3000):
            if len(eng.store) == 0 and eng.pages_in_use() == 0:
                break
            await asyncio.sleep(0.01)
        assert len(eng.store) == 0 and eng.pages_in_use() == 0
    finally:
        await eng.shutdown()

