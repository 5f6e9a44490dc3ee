"""One client's request never hurts the others: a field past any bound is a
400 while its neighbours complete, and a huge prompt is refused by its length
before it is tokenised, or tokenised off the event loop while /health answers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from http_support import running_engine, serving

from mstar.engine import engine as engine_module

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "user", "content": "hi"}]
HUGE = 2**63


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llama(engine):
    async with serving(engine) as url:
        yield engine, url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def orpheus():
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield engine, url


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("path, good, bad, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 8}, {"top_k": HUGE}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8}, {"top_k": 2**40}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8}, {"stop_token_ids": [2**40]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8}, {"seed": HUGE * 2}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8}, {"min_tokens": 9}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}, {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}, {"top_k": HUGE}, "top_k"),
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 8}},
     {"sampling_params": {"max_tokens": 8, "top_k": HUGE}}, "sampling_params.top_k"),
])
async def test_a_field_past_its_bound_fails_alone(llama, path: str, good: dict, bad: dict, param: str) -> None:
    engine, url = llama
    async with aiohttp.ClientSession() as http:
        goods = [_post(http, url + path, good) for _ in range(20)]
        answers = await asyncio.gather(_post(http, url + path, {**good, **bad}), *goods)
    status, body = answers[0]
    assert status == 400, body
    assert orjson.loads(body)["error"]["param"] == param
    assert [s for s, _ in answers[1:]] == [200] * 20
    assert engine.health()["requests_running"] == 0


async def test_speech_with_a_field_past_its_bound_fails_alone(orpheus) -> None:
    engine, url = orpheus
    good = {"input": "hi", "voice": "tara", "response_format": "pcm", "max_tokens": 28, "seed": 1}
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(_post(http, url + "/v1/audio/speech", {**good, "top_k": HUGE}),
                                       *[_post(http, url + "/v1/audio/speech", good) for _ in range(6)])
    assert answers[0][0] == 400 and b"top_k" in answers[0][1]
    assert [s for s, _ in answers[1:]] == [200] * 6
    assert all(len(b) > 0 for _, b in answers[1:])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a" * (8 << 20), "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (8 << 20)}]}, "messages"),
    ("/generate", {"text": "a" * (8 << 20)}, "text"),
])
async def test_a_prompt_past_any_context_is_refused_by_its_length(llama, path: str, body: dict,
                                                                   param: str) -> None:
    engine, url = llama
    tokenizer = engine.tokenizer("tiny-llama")
    calls = []
    real = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
    finally:
        del tokenizer.encode
    assert error["param"] == param and "characters" in error["message"]
    assert calls == []  # refused before tokenising


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "b" * 30_000, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 30_000}]}),
    ("/generate", {"text": "b" * 30_000}),
])
async def test_a_long_prompt_is_tokenised_off_the_event_loop(llama, monkeypatch, path: str, body: dict) -> None:
    """The tokenizer holds until /health has answered: were it called on the
    event loop, /health could not answer and the request would never end."""
    engine, url = llama
    monkeypatch.setattr(engine_module, "OFF_LOOP_SIZE", 1000)
    tokenizer = engine.tokenizer("tiny-llama")
    health_answered = threading.Event()
    real = tokenizer.encode

    def held(*a: Any, **k: Any) -> list[int]:
        assert health_answered.wait(timeout=20), "tokenising blocked /health"
        return real(*a, **k)

    tokenizer.encode = held
    try:
        async with aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(_post(http, url + path, body))
            await asyncio.sleep(0.05)
            async with http.get(url + "/health") as r:
                assert r.status == 200
            health_answered.set()
            status, answer = await asyncio.wait_for(pending, timeout=30)
    finally:
        del tokenizer.encode
    # 30,000 bytes are 30,000 tokens of the byte tokenizer: past the 2,048 context, found by tokenising
    assert status == 400 and b"context" in answer
