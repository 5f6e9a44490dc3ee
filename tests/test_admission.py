"""Admission under load: a bounded waiting line; a new request waits for room
up to the queue timeout, then gets 429 with Retry-After; a stopped engine
answers 503."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from fake_model import FakeModel, Hold
from http_support import serving
from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.errors import SHUTTING_DOWN, RequestError
from mstar.types import GenerateRequest, SamplingParams


async def test_a_full_waiting_line_answers_429_after_the_queue_timeout() -> None:
    hold = Hold()
    eng = Engine(EngineConfig(model="fake", max_waiting_requests=2, queue_timeout=0.05),
                 model=FakeModel(gate=hold, max_steps=3))
    await eng.start()
    try:
        await eng.admit()  # room
        streams = [eng.submit(GenerateRequest(f"r{i}", "fake", {"x": 0}, SamplingParams(), walk="count"))
                   for i in range(2)]
        with pytest.raises(RequestError) as e:
            await eng.admit()
        assert e.value.status == 429 and e.value.retry_after and "limit is 2" in str(e.value)
        # room appears while a request waits: it is admitted before its deadline
        waiter = asyncio.create_task(eng.admit(timeout=10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        hold.released.set()
        await asyncio.wait_for(waiter, 10)
        for s in streams:
            assert [c async for c in s][-1].finish_reason == "length"
    finally:
        hold.released.set()
        await eng.shutdown()
    with pytest.raises(RequestError) as e:
        await eng.admit()
    assert e.value.status == 503


async def test_http_answers_429_with_retry_after() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", max_waiting_requests=0, queue_timeout=0.01))
    await eng.start()
    try:
        async with serving(eng) as base, aiohttp.ClientSession(base_url=base) as http:
            async with http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi"}) as r:
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
                body = await r.json()
                assert body["error"]["code"] == "queue_full"
                assert body["error"]["type"] == "requests"  # OpenAI's type for a 429 of too many requests
            async with http.get("/health") as r:  # not a generation route: never held back
                assert r.status == 200
            async with http.get("/metrics") as r:
                assert "\nmstar_requests_refused_total 1\n" in await r.text()
    finally:
        await eng.shutdown()


async def test_a_full_waiting_line_refuses_a_realtime_response_as_http_does() -> None:
    """The same refusal over the realtime socket: an `error` event of the
    type and code a 429 answer has."""
    eng = Engine(EngineConfig(model="orpheus-tiny", max_waiting_requests=0, queue_timeout=0.01))
    await eng.start()
    try:
        async with serving(eng) as base, aiohttp.ClientSession() as http:
            async with http.post(base + "/v1/audio/speech", json={"model": "orpheus-tiny", "input": "hi"}) as r:
                assert r.status == 429
                refused = (await r.json())["error"]
            ws = await http.ws_connect(base.replace("http://", "ws://") + "/v1/realtime?model=orpheus-tiny")
            assert (await ws.receive_json(timeout=30))["type"] == "session.created"
            await ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}})
            await ws.send_json({"type": "response.create"})
            while (event := await ws.receive_json(timeout=30))["type"] != "error":
                pass
            await ws.close()
        assert (event["error"]["type"], event["error"]["code"]) == (refused["type"], refused["code"]) == \
            ("requests", "queue_full")
    finally:
        await eng.shutdown()


async def test_a_drain_refuses_requests_waiting_for_room_and_late_submissions() -> None:
    """SIGTERM with the waiting line full: the requests waiting for room used to be let in when the drain
    aborted the running ones, then streamed until aiohttp cut them, past the 10 s the process promises."""
    hold = Hold()
    eng = Engine(EngineConfig(model="fake", max_waiting_requests=1, queue_timeout=30),
                 model=FakeModel(gate=hold, max_steps=3))
    await eng.start()
    try:
        stream = eng.submit(GenerateRequest("r0", "fake", {"x": 0}, SamplingParams(), walk="count"))
        waiter = asyncio.create_task(eng.admit())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        drain = asyncio.create_task(eng.drain(0.5))
        with pytest.raises(RequestError) as e:  # at once, not when the drain frees the line
            await asyncio.wait_for(waiter, 0.2)
        assert e.value.status == 503 and e.value.retry_after
        assert await drain == 1
        assert [c async for c in stream][-1].finish_reason == "abort"
        # admitted before the signal, its body read after the drain ended: nothing would abort it now
        with pytest.raises(RequestError) as e:
            eng.submit(GenerateRequest("r1", "fake", {"x": 0}, SamplingParams(), walk="count"))
        assert e.value.status == 503 and "r1" not in eng._states
    finally:
        hold.released.set()
        await eng.shutdown()


async def test_a_drain_refuses_at_once_the_requests_queued_behind_the_running_ones() -> None:
    """SIGTERM with one request running and two queued behind it (one row at a time): the two never ran, so
    they end at once, refused as the server is shutting down (the routes answer 503 with Retry-After), and only
    the running one gets the grace before it is aborted."""
    eng = Engine(EngineConfig(model="tiny-llama", devices=("cpu",), scheduler=SchedulerConfig(max_num_seqs=1)))
    await eng.start()
    module = eng.workers[0].runners["llm"].module
    decode = module.decode

    def slow_decode(batch):  # type: ignore[no-untyped-def]
        time.sleep(0.005)  # the running row must outlast the grace on any box: 2,000 steps take 10 s at least
        return decode(batch)

    module.decode = slow_decode
    try:
        sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        running = aiter(eng.submit(GenerateRequest("run", eng.model_name, {"prompt_ids": [5, 6, 7]}, sp,
                                                   walk="generate")))
        first = await anext(running)  # it runs: its first token is out
        assert first.token_ids
        queued = [eng.submit(GenerateRequest(f"q{i}", eng.model_name, {"prompt_ids": [8, 9]}, sp, walk="generate"))
                  for i in range(2)]
        await asyncio.sleep(0.2)  # they wait for the one running row
        grace = 3.0
        t0 = time.monotonic()
        drain = asyncio.create_task(eng.drain(grace))
        for q in queued:
            chunks = [c async for c in q]
            assert [c.token_ids for c in chunks if c.token_ids] == []  # it never produced a token
            assert chunks[-1].finish_reason == "abort" and chunks[-1].error == SHUTTING_DOWN, chunks[-1]
        assert time.monotonic() - t0 < grace / 2, "the queued requests waited for the grace"
        assert await drain == 1  # the running one, at the grace's end
        assert [c async for c in running][-1].finish_reason == "abort"
        for _ in range(100):  # its worker's word that it let the aborted row go
            if eng.num_running() == 0:
                break
            await asyncio.sleep(0.05)
        assert eng.num_running() == 0
    finally:
        await eng.shutdown()


async def test_over_http_a_request_refused_at_shutdown_is_a_503_with_retry_after() -> None:
    """The route's answer for a request the drain refused before it began: 503 `unavailable` with Retry-After
    (a client or a cluster front retries it elsewhere), not the `aborted` of a request cut while it ran."""
    eng = Engine(EngineConfig(model="tiny-llama", devices=("cpu",), scheduler=SchedulerConfig(max_num_seqs=1)))
    await eng.start()
    try:
        async with serving(eng) as url, aiohttp.ClientSession() as http:
            long = {"model": eng.model_name, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            async with http.post(url + "/v1/completions", json=long) as running:
                assert running.status == 200
                await running.content.readline()  # it runs
                # whole, streamed (its headers wait for its first chunk) and the native route's NDJSON
                queued = [asyncio.ensure_future(http.post(url + path, json=body)) for path, body in (
                    ("/v1/completions", {**long, "stream": False}), ("/v1/completions", long),
                    ("/generate", {"model": eng.model_name, "text": "hello", "stream": True,
                                   "sampling_params": {"max_tokens": 2000, "ignore_eos": True}}))]
                await asyncio.sleep(0.3)
                drain = asyncio.create_task(eng.drain(2.0))
                for r in await asyncio.wait_for(asyncio.gather(*queued), 1.5):
                    body = await r.json()
                    assert r.status == 503 and r.headers.get("Retry-After") == "5", (r.status, body)
                    assert body["error"]["code"] == "unavailable" and "had not started" in body["error"]["message"]
                await drain
    finally:
        await eng.shutdown()


async def test_over_http_a_whole_answer_cut_at_shutdown_is_a_503_aborted_with_retry_after() -> None:
    """A non-streamed request still running when the drain's grace ends: 503 `aborted`, with Retry-After as every
    503 has (the cluster front does not send it on: it may have had effects; its client may)."""
    eng = Engine(EngineConfig(model="tiny-llama", devices=("cpu",), scheduler=SchedulerConfig(max_num_seqs=1)))
    await eng.start()
    try:
        async with serving(eng) as url, aiohttp.ClientSession() as http:
            long = {"model": eng.model_name, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
            running = asyncio.ensure_future(http.post(url + "/v1/completions", json=long))
            for _ in range(200):  # started on the worker (its pages taken), not only submitted: a request still
                if eng.num_running() and eng.pages_in_use():  # in line at the drain is refused, "unavailable"
                    break
                await asyncio.sleep(0.02)
            assert eng.num_running() == 1 and eng.pages_in_use()
            await eng.drain(0.2)
            r = await asyncio.wait_for(running, 5)
            body = await r.json()
            assert r.status == 503 and r.headers.get("Retry-After") == "5", (r.status, body)
            assert body["error"]["code"] == "aborted"
    finally:
        await eng.shutdown()
