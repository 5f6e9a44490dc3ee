"""The prefix cache: page keys as a hash chain, cached pages kept by the pool
until it needs them, admission with shared pages, and a served Llama whose
outputs are the same with the cache on or off while later prompts skip the
prefix they share, leaving no page held once they end."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tiny_llama import generated, save_tiny_llama
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
import mstar.scheduler.scheduler as scheduler_module
from mstar.scheduler import ModeCaps, PagePool, Scheduler, WorkItem
from mstar.scheduler.prefix_cache import PrefixCache, page_keys
from mstar.types import GenerateRequest, SamplingParams

pytest.importorskip("transformers")

VOCAB = 384


def test_page_keys_chain_whole_pages_and_their_parents() -> None:
    a = torch.arange(40)
    keys = page_keys(a.tolist(), 16)
    assert len(keys) == 2 and len(set(keys)) == 2
    late = a.clone()
    late[37] = 0  # in the partial third page: no key covers it
    assert page_keys(late.tolist(), 16) == keys == page_keys(a[:32].tolist(), 16)
    early = a.clone()
    early[3] = 0  # the first page differs, so does every page after it
    assert not set(page_keys(early.tolist(), 16)) & set(keys)
    assert not set(page_keys(a.tolist(), 16, salt=b"other")) & set(keys)
    assert page_keys(a[:15].tolist(), 16) == ()


def test_the_pool_keeps_cached_pages_until_an_allocation_needs_them() -> None:
    pool = PagePool(4, 2)
    cache = PrefixCache(pool)
    keys = page_keys(list(range(4)), 2)
    pages = pool.allocate(2)
    cache.insert(keys, pages)
    pool.free(pages)
    assert (pool.num_free, pool.num_used, pool.num_cached, len(cache)) == (4, 0, 2, 2)
    assert cache.match(keys) == pages
    pool.share(pages)  # a hit takes them back from the kept line
    assert (pool.num_used, pool.num_cached) == (2, 0)
    pool.free(pages)
    assert pool.allocate(5) is None and len(cache) == 2
    taken = pool.allocate(3)  # the two never used, then the least recently freed kept page
    assert taken is not None and taken[2] == pages[0]
    assert cache.match(keys) == [] and len(cache) == 1 and cache.stats.evicted == 1
    fresh = PagePool(2, 1)  # a page no row ever held can be neither kept nor shared
    with pytest.raises(ValueError):
        fresh.keep(0)
    with pytest.raises(ValueError):
        fresh.share([0])


def _item(rid: str, n: int, pool: PagePool, prefix: bool = True) -> WorkItem:
    ids = list(range(n))
    return WorkItem(rid, "main", "llm", "prefill", num_tokens=n, pages_needed=pool.pages_for(n), starts_row=True,
                    prefix=page_keys(ids, pool.page_size) if prefix else ())


def test_a_row_starting_with_a_cached_prefix_shares_its_pages_and_computes_at_least_one_token() -> None:
    pool = PagePool(16, 4)
    sched = Scheduler({("llm", "prefill"): ModeCaps(8, 1000)}, {"llm": pool}, prefix_caching=True)
    first = _item("a", 12, pool)
    sched.add(first)
    assert sched.schedule().items == [first] and first.cached_tokens == 0
    sched.cache_prefix(first, first.granted)
    same = _item("b", 12, pool)  # its three pages are cached; the last is computed again for its logits
    longer = _item("c", 13, pool)
    sched.add(same)
    sched.add(longer)
    assert sched.schedule().items == [same, longer]
    assert same.granted[:2] == first.granted[:2] and same.granted[2] not in first.granted
    assert same.cached_tokens == 8
    assert longer.granted[:3] == first.granted and longer.cached_tokens == 12 and len(longer.granted) == 4
    assert [pool.refcount(p) for p in first.granted] == [3, 3, 2]
    cache = sched.caches["llm"]
    assert (cache.stats.queries, cache.stats.hits) == (12 + 12 + 13, 8 + 12)
    # a hit whose fresh pages do not fit waits, and gives its shared pages back
    pool.free(same.granted + longer.granted)
    held = pool.allocate(1)
    big = _item("d", 64, pool)  # 16 pages: the 3 cached and 13 fresh, with 12 free
    sched.add(big)
    assert pool.num_free == 12 and sched.schedule() is None
    assert big.granted == [] and [pool.refcount(p) for p in first.granted] == [1, 1, 1]
    pool.free(held)
    assert sched.schedule().items == [big] and big.cached_tokens == 12


def test_prompts_that_start_alike_in_one_step_compute_their_first_pages_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows queued together whose prompts share uncached full pages: one computes them, the others wait a
    step and find them cached (prompts of `SHARE_MIN_TOKENS` or more; the test's are short, so it is lowered)."""
    monkeypatch.setattr(scheduler_module, "SHARE_MIN_TOKENS", 8)
    pool = PagePool(64, 4)
    sched = Scheduler({("llm", "prefill"): ModeCaps(8, 1000)}, {"llm": pool}, prefix_caching=True)
    a, b, c = _item("a", 12, pool), _item("b", 12, pool), _item("c", 13, pool)
    other = WorkItem("o", "main", "llm", "prefill", num_tokens=12, pages_needed=3, starts_row=True,
                     prefix=page_keys(list(range(50, 62)), 4))
    short = _item("s", 4, pool)  # no full page it could take from the cache: never waits
    for item in (a, b, other, c, short):
        sched.add(item)
    assert sched.schedule().items == [a, other, short]
    sched.cache_prefix(a, a.granted)
    assert sched.schedule().items == [b, c]
    assert (b.cached_tokens, c.cached_tokens) == (8, 12) and b.granted[:2] == c.granted[:2] == a.granted[:2]


def test_short_prompts_that_start_alike_are_computed_in_the_one_step() -> None:
    """Under `SHARE_MIN_TOKENS` a duplicate does not wait a step for the cache: computing it again costs less."""
    pool = PagePool(64, 4)
    sched = Scheduler({("llm", "prefill"): ModeCaps(8, 1000)}, {"llm": pool}, prefix_caching=True)
    a, b = _item("a", 12, pool), _item("b", 12, pool)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().items == [a, b]


def test_without_prefix_caching_no_row_shares() -> None:
    pool = PagePool(16, 4)
    sched = Scheduler({("llm", "prefill"): ModeCaps(8, 1000)}, {"llm": pool})
    assert sched.caches == {}
    a, b = _item("a", 12, pool), _item("b", 12, pool)
    sched.add(a)
    sched.schedule()
    sched.cache_prefix(a, a.granted)
    sched.add(b)
    sched.schedule()
    assert b.cached_tokens == 0 and not set(a.granted) & set(b.granted)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama_prefix"), VOCAB)


async def _settled(eng: Engine) -> None:
    for _ in range(3000):
        if eng.pages_in_use() == 0 and not any(w.walker.runs for w in eng.workers):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{eng.pages_in_use()} pages still held")


def _cases() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(45)]
    tails = [[], [rng.randrange(3, VOCAB)], [rng.randrange(3, VOCAB) for _ in range(7)], shared[1:4]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)]
    return [(shared + tail, sp) for tail in tails for sp in params]


async def _serve(folder: Path, caching: bool, device: str) -> tuple[list[list[int]], Engine]:
    eng = Engine(EngineConfig(model=str(folder), devices=(device,), dtype="float32",
                              scheduler=SchedulerConfig(page_size=4, num_pages=256, prefix_caching=caching)))
    await eng.start()
    cases = _cases()
    first = [await generated(eng, "first", *cases[0])]  # alone: the prefix enters the cache
    together = await asyncio.gather(*[generated(eng, f"r{i}", p, sp) for i, (p, sp) in enumerate(cases)])
    return first + together, eng


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
async def test_greedy_seeded_and_penalised_outputs_are_the_same_with_the_cache_on_or_off(
        hf_folder: Path, device: str) -> None:
    off, eng_off = await _serve(hf_folder, False, device)
    try:
        await _settled(eng_off)
        assert eng_off.workers[0].scheduler.caches == {} and eng_off.workers[0].pools["llm"].num_cached == 0
    finally:
        await eng_off.shutdown()
    on, eng = await _serve(hf_folder, True, device)
    try:
        assert on == off
        stats = eng.health()["devices"][0]["prefix_cache"]["llm"]
        # every request after the first found the shared 44 tokens (11 pages) at least
        assert stats["hits"] >= 44 * len(_cases()) and stats["queries"] > stats["hits"]
        await _settled(eng)
        pool = eng.workers[0].pools["llm"]
        assert pool.num_used == 0 and pool.num_cached == stats["pages"] > 0
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("share_from", [32, 64])
async def test_a_prompt_sent_four_times_at_once_is_computed_once_if_long(hf_folder: Path, share_from: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests of one prompt submitted together (as a request's `n` samples are): a prompt of
    `SHARE_MIN_TOKENS` or more is computed by the first, and the other three start from its pages a step
    later; a shorter one is computed four times in the one step. Every answer is what it is without the cache.
    The burst gate (opt-in) starts the four in one step: without it the first may run before the worker has
    applied the others, and they would find its pages cached."""
    monkeypatch.setattr(scheduler_module, "SHARE_MIN_TOKENS", share_from)
    prompt = _cases()[0][0][:41]  # ten full pages of four tokens and one more token
    answers = {}
    for caching in (False, True):
        eng = Engine(EngineConfig(model=str(hf_folder), dtype="float32", scheduler=SchedulerConfig(
            page_size=4, num_pages=256, prefix_caching=caching, admission_gather_ms=20)))
        await eng.start()
        try:
            answers[caching] = await asyncio.gather(*[generated(
                eng, f"n{i}", prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=i)) for i in range(4)])
            if caching:
                stats = eng.health()["devices"][0]["prefix_cache"]["llm"]
                assert (stats["queries"], stats["hits"]) == (4 * 41, 3 * 40 if len(prompt) >= share_from else 0)
        finally:
            await eng.shutdown()
    assert answers[True] == answers[False]


async def test_aborted_rows_leave_only_cached_pages(hf_folder: Path) -> None:
    for caching in (True, False):
        eng = Engine(EngineConfig(model=str(hf_folder), scheduler=SchedulerConfig(page_size=4, num_pages=128,
                                                                                   prefix_caching=caching)))
        await eng.start()
        try:
            prompt, sp = _cases()[0]
            await generated(eng, "warm", prompt, sp)
            streams = [eng.submit(GenerateRequest(f"x{i}", eng.model_name, {"prompt_ids": prompt + [5 + i]},
                                                  SamplingParams(max_tokens=40, ignore_eos=True)))
                       for i in range(12)]
            for i, s in enumerate(streams):
                if i % 2:
                    eng.abort(s.request_id)
            for s in streams:
                async for _ in s:
                    pass
            await _settled(eng)
            pool = eng.workers[0].pools["llm"]
            assert pool.num_used == 0
            assert (pool.num_cached > 0) == caching and pool.num_free == pool.num_pages
        finally:
            await eng.shutdown()
