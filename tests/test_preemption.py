"""Lazy KV pages and preemption (`--kv-reservation lazy`): with a pool far
smaller than the requests' total need, running rows are swapped out and
resumed, and every request still gets exactly the output it gets with its
pages reserved up front; aborts while swapped out leak nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import weakref

import numpy as np
import pytest
import torch

from mstar.config import EngineConfig, SchedulerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.engine.memory.kv_cache import KVCache
from mstar.models.base import KVSpec
from mstar.types import GenerateRequest, SamplingParams
from toys.hybrid import ToyHybridModel

MAX_LEN = 128
PAGE = 4


async def _run(model: str, reservation: str, pages: int, n: int, tokens: int,
               abort_after: dict[int, int] | None = None) -> tuple[list, Engine]:
    """Every request's (token ids, PCM bytes, finish reason), and the stopped engine."""
    eng = Engine(EngineConfig(model=model, max_model_len=MAX_LEN, scheduler=SchedulerConfig(
        page_size=PAGE, num_pages=pages, kv_reservation=reservation)))
    await eng.start()
    sp = SamplingParams(max_tokens=tokens, temperature=0.8, repetition_penalty=1.3, ignore_eos=True)

    async def one(i: int) -> tuple[list[int], bytes, str | None]:
        inputs = {"text": f"request {i}"} if model == "orpheus-tiny" else {"prompt_ids": list(range(5 + i, 25 + i))}
        ids: list[int] = []
        audio, reason = b"", None
        seen = 0
        async for c in eng.submit(GenerateRequest(f"r{i}", model, inputs, dataclasses.replace(sp, seed=i))):
            ids += c.token_ids
            audio += c.audio or b""
            seen += 1
            if abort_after and seen == abort_after.get(i):
                eng.abort(f"r{i}")
            reason = c.finish_reason or reason
        return ids, audio, reason

    try:
        out = list(await asyncio.gather(*[one(i) for i in range(n)]))
        for _ in range(3000):  # aborts reach the worker a step later
            if not eng.workers[0].walker.runs:
                break
            await asyncio.sleep(0.01)
        assert eng.workers[0].pages_in_use() == {"llm": 0}
        assert eng.workers[0].scheduler.running == {"llm": 0}
        assert len(eng.store) == 0 and not eng.workers[0].scheduler.has_work()
        return out, eng
    finally:
        await eng.shutdown()


def _preemptions(eng: Engine) -> int:
    return eng.workers[0].preemption.preempted


async def test_preempted_requests_get_the_same_tokens() -> None:
    reserved, _ = await _run("tiny-llama", "request", 512, n=6, tokens=60)
    # 32 pages hold one 128-token request: six 80-token requests must take turns
    lazy, eng = await _run("tiny-llama", "lazy", 32, n=6, tokens=60)
    assert _preemptions(eng) > 0 and eng.workers[0].preemption.resumed == _preemptions(eng)
    assert [r[0] for r in lazy] == [r[0] for r in reserved]
    assert all(len(r[0]) == 60 and r[2] == "length" for r in lazy)
    assert "mstar_preemptions_total " + str(_preemptions(eng)) in eng.metrics_text()


async def test_aborts_during_preemption_leak_nothing() -> None:
    reserved, _ = await _run("tiny-llama", "request", 512, n=6, tokens=60)
    lazy, eng = await _run("tiny-llama", "lazy", 36, n=6, tokens=60, abort_after={1: 5, 4: 30})
    assert _preemptions(eng) > 0
    assert [r[2] for r in lazy] == ["length", "abort", "length", "length", "abort", "length"]
    for i in (0, 2, 3, 5):
        assert lazy[i][0] == reserved[i][0]


async def test_preempted_speech_sounds_the_same() -> None:
    reserved, _ = await _run("orpheus-tiny", "request", 512, n=4, tokens=70)
    lazy, eng = await _run("orpheus-tiny", "lazy", 40, n=4, tokens=70)
    assert _preemptions(eng) > 0
    for a, b in zip(reserved, lazy):
        x = np.frombuffer(a[1], "<i2").astype(np.int32)
        y = np.frombuffer(b[1], "<i2").astype(np.int32)
        assert x.size > 0 and x.size == y.size
        assert np.abs(x - y).max() <= 2  # the same tokens; codec batches differ in float rounding only


async def _mixed(reservation: str, pages: int) -> tuple[list[list[int]], list[bool]]:
    """Four requests with max_tokens and three without (free to fill the
    context) at once: each one's tokens, and whether each row preemption took
    was one that takes its pages as it goes."""
    eng = Engine(EngineConfig(model="tiny-llama", max_model_len=MAX_LEN, scheduler=SchedulerConfig(
        page_size=PAGE, num_pages=pages, kv_reservation=reservation)))
    await eng.start()
    taken: list[bool] = []
    preemption = eng.workers[0].preemption
    if preemption is not None:
        swap = preemption._swap
        preemption._swap = lambda row, component: (taken.append(row.grows), swap(row, component))[1]

    async def one(i: int) -> list[int]:
        sp = SamplingParams(max_tokens=40 if i % 2 == 0 else None, temperature=0.8, seed=i, ignore_eos=True)
        request = GenerateRequest(f"r{i}", "tiny-llama", {"prompt_ids": list(range(5 + i, 25 + i))}, sp)
        return [t async for c in eng.submit(request) for t in c.token_ids]

    try:
        out = list(await asyncio.gather(*[one(i) for i in range(7)]))
        for _ in range(3000):
            if not eng.workers[0].walker.runs:
                break
            await asyncio.sleep(0.01)
        assert eng.workers[0].pages_in_use() == {"llm": 0} and eng.workers[0].scheduler.running == {"llm": 0}
        return out, taken
    finally:
        await eng.shutdown()


async def test_auto_reserves_for_a_bounded_answer_and_lets_an_open_one_grow() -> None:
    """`--kv-reservation auto` (the default): a request with max_tokens holds
    its pages from the start and is never preempted; one without takes pages
    as it goes (three of them would reserve a 40-page pool thrice over) and
    is swapped out when they run short; everyone's tokens are what they are
    with every page reserved in a pool large enough."""
    reserved, _ = await _mixed("request", 1024)
    auto, taken = await _mixed("auto", 40)
    assert auto == reserved
    assert [len(t) for t in auto] == [40, MAX_LEN - 20] * 3 + [40]
    assert taken and all(taken)  # preempted, and only rows that grow


@pytest.mark.parametrize("reservation", ["request", "lazy", "auto"])
async def test_a_stopped_worker_lets_go_of_its_kv_cache_and_state_slots(reservation: str) -> None:
    """Shutdown gives the KV caches and state slots back though the engine
    and its workers live on (a worker sits in reference cycles until the
    cyclic collector runs), in every mode: under lazy and auto `Preemption`
    holds them too, and a process starting many engines must not keep each
    one's pool."""
    eng = Engine(EngineConfig(model="toy-hybrid", devices=("cpu",), scheduler=SchedulerConfig(
        kv_reservation=reservation)), model=ToyHybridModel())
    await eng.start()
    try:
        runner = next(r for r in eng.workers[0].runners.values() if r.kv is not None and r.state is not None)
        held = [weakref.ref(runner.kv), weakref.ref(runner.state)]
        del runner
        params = SamplingParams(max_tokens=4, temperature=0.0, seed=1)
        async for _ in eng.submit(GenerateRequest("r", "toy-hybrid", {"prompt_ids": [1, 2, 3]}, params)):
            pass
    finally:
        await eng.shutdown()
    assert [ref() for ref in held] == [None, None]


def test_swap_round_trip_moves_pages() -> None:
    cache = KVCache(KVSpec(num_layers=2, num_kv_heads=2, head_dim=4), 8, PAGE, "cpu", torch.float32)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t[[1, 5]].clone() for t in cache.k + cache.v]
    saved = cache.swap_out([1, 5])
    for t in cache.k + cache.v:
        t.zero_()
    cache.swap_in(saved, [6, 0])
    assert all(torch.equal(t[[6, 0]], b) for t, b in zip(cache.k + cache.v, before))


def test_kv_reservation_flag() -> None:
    assert parse_args([]).engine.scheduler.kv_reservation == "auto"
    assert parse_args(["--kv-reservation", "request"]).engine.scheduler.kv_reservation == "request"
    assert parse_args(["--kv-reservation", "lazy"]).engine.scheduler.kv_reservation == "lazy"


async def test_running_rows_are_capped_at_max_num_seqs() -> None:
    """Past max_num_seqs running rows, a new request waits for a slot instead
    of slowing every running one down."""
    eng = Engine(EngineConfig(model="tiny-llama", max_model_len=MAX_LEN,
                              scheduler=SchedulerConfig(max_num_seqs=2, page_size=PAGE)))
    widest = 0

    def watch(report) -> None:
        nonlocal widest
        if report.mode == "decode":
            widest = max(widest, report.rows)
            assert eng.workers[0].scheduler.running["llm"] <= 2

    eng.add_report_hook(watch)
    await eng.start()
    try:
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

        async def one(i: int) -> int:
            n = 0
            async for c in eng.submit(GenerateRequest(f"r{i}", "tiny-llama", {"prompt_ids": [3 + i, 4, 5]}, sp)):
                n += len(c.token_ids)
            return n

        assert await asyncio.gather(*[one(i) for i in range(6)]) == [20] * 6
        assert widest == 2
        assert eng.workers[0].scheduler.running == {"llm": 0}
    finally:
        await eng.shutdown()
