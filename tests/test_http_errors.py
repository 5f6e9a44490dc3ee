"""The HTTP routes refusing bad requests (4xx JSON naming the field) and
aborting the engine requests of clients that hang up, against the real
tiny-llama engine on a loopback port."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from http_support import running_engine, serving, wait_until

from mstar.engine.engine import Engine
from mstar.http.server import MAX_BODY_BYTES

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "user", "content": "hi"}]


async def error_of(response: aiohttp.ClientResponse) -> dict[str, Any]:
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path, data, param", [
    ("/v1/completions", b"{not json", "body"),
    ("/v1/completions", b"[1]", "body"),
    ("/v1/completions", b"", "body"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 10000000000000000000000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2048}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "0"}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 2}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', "echo"),
    ("/v1/completions", b'{"prompt": [1, 99999]}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", [1, -1]]}', "prompt[1]"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 1}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"response_format": {"type": "json_object"}}', "response_format"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4096}',
     "max_tokens"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_k": "5"}}', "sampling_params.top_k"),
    ("/generate", b'{"input_ids": [300]}', "input_ids"),
])
async def test_bad_requests_are_400_naming_the_field(http: aiohttp.ClientSession, path: str, data: bytes,
                                                      param: str) -> None:
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = await error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


async def test_a_prompt_longer_than_the_context_names_the_prompt(http: aiohttp.ClientSession) -> None:
    async with http.post("/v1/completions", json={"prompt": [5] * 2048}) as r:
        assert r.status == 400 and (await error_of(r))["param"] == "prompt"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 2048}, "prompt"),
])
async def test_whatever_does_not_fit_the_context_is_context_length_exceeded(http: aiohttp.ClientSession, path: str,
                                                                            body: dict, param: str) -> None:
    # OpenAI's code for a prompt or a max_tokens past the context, whichever check finds it first
    async with http.post(path, json=body) as r:
        assert r.status == 400
        err = await error_of(r)
    assert (err["param"], err["code"], err["type"]) == (param, "context_length_exceeded", "invalid_request_error")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-nope", "prompt": "x"}),
    ("/v1/chat/completions", {"model": "gpt-nope", "messages": CHAT}),
    ("/generate", {"model": "gpt-nope", "text": "x"}),
])
async def test_unknown_model_is_404_naming_it(http: aiohttp.ClientSession, path: str, body: dict) -> None:
    async with http.post(path, json=body) as r:
        assert r.status == 404
        err = await error_of(r)
    assert "gpt-nope" in err["message"] and err["param"] == "model" and err["code"] == "model_not_found"


async def test_an_oversized_body_gets_a_413_naming_the_limit(http: aiohttp.ClientSession) -> None:
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    async with http.post("/v1/completions", data=big, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
        error = (await r.json())["error"]
        assert str(MAX_BODY_BYTES) in error["message"]


async def test_unknown_route_and_method_are_json(http: aiohttp.ClientSession) -> None:
    async with http.get("/v1/nothing") as r:
        assert r.status == 404 and "/v1/nothing" in (await error_of(r))["message"]
    async with http.get("/v1/completions") as r:
        assert r.status == 405 and (await error_of(r))["message"]
        assert r.headers["Allow"] == "POST"  # RFC 9110: a 405 names the methods the route takes


async def test_refused_requests_leave_nothing_running(http: aiohttp.ClientSession, engine: Engine) -> None:
    # The second prompt is refused after the first was tokenised: nothing may be left behind.
    async with http.post("/v1/completions", json={"prompt": ["fine", [1, 999]], "n": 3}) as r:
        assert r.status == 400
    assert engine.health()["requests_running"] == 0


def pages_in_use(engine: Engine) -> int:
    return sum(sum(d["kv_pages_in_use"].values()) for d in engine.health()["devices"])


async def hang_up_mid_stream(base: str, engine: Engine, path: str, body: dict, events: int) -> None:
    """Read the first `events` events of a long stream, drop the connection,
    and check the engine aborted the request and freed its pages."""
    aborted = engine.stats["requests_aborted"]
    async with aiohttp.ClientSession() as session:
        response = await session.post(base + path, json=body)
        assert response.status == 200
        while events:
            line = await response.content.readline()
            assert line, "the stream ended early"
            events -= bool(line.strip())
        assert engine.health()["requests_running"] == 1 and pages_in_use(engine) > 0
        response.close()  # closes the socket: the client is gone
    assert await wait_until(lambda: engine.health()["requests_running"] == 0)
    assert engine.stats["requests_aborted"] == aborted + 1
    assert pages_in_use(engine) == 0


LONG = {"max_tokens": 2000, "ignore_eos": True}


@pytest.mark.parametrize("cancel_handlers", [True, False], ids=["cancelled", "write-fails"])
async def test_hanging_up_a_native_stream_aborts_it(engine: Engine, cancel_handlers: bool) -> None:
    async with serving(engine, cancel_handlers) as base:
        await hang_up_mid_stream(base, engine, "/generate",
                                 {"text": "go on", "stream": True, "sampling_params": LONG}, events=1)


@pytest.mark.parametrize("cancel_handlers", [True, False], ids=["cancelled", "write-fails"])
async def test_hanging_up_an_sse_stream_aborts_it(engine: Engine, cancel_handlers: bool) -> None:
    async with serving(engine, cancel_handlers) as base:
        await hang_up_mid_stream(base, engine, "/v1/chat/completions",
                                 {"messages": CHAT, "stream": True, **LONG}, events=2)  # the role, then content
        await hang_up_mid_stream(base, engine, "/v1/completions",
                                 {"prompt": "go on", "stream": True, **LONG}, events=1)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "go on", "stream": True, **LONG}),
                                        ("/generate", {"text": "go on", "stream": True, "sampling_params": LONG})])
async def test_a_client_gone_before_a_streams_headers_is_a_499(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                             path: str, body: dict) -> None:
    """A client that hangs up at once fails the stream's first write, its headers' (aiohttp raises a
    `ConnectionResetError`): that is a 499 and an abort, as a hang-up before any answer, not a logged 500."""
    prepare = web.StreamResponse.prepare

    async def closing(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if type(self) is web.StreamResponse:  # the stream's; the 499's own `web.Response` goes out
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await prepare(self, request)

    aborted = engine.stats["requests_aborted"]
    monkeypatch.setattr(web.StreamResponse, "prepare", closing)
    async with serving(engine) as base, aiohttp.ClientSession() as session:
        async with session.post(base + path, json=body) as r:
            assert r.status == 499
    assert await wait_until(lambda: engine.health()["requests_running"] == 0)
    assert engine.stats["requests_aborted"] == aborted + 1 and pages_in_use(engine) == 0


@pytest.mark.parametrize("cancel_handlers", [True, False], ids=["cancelled", "transport-closed"])
async def test_hanging_up_a_plain_request_aborts_it(engine: Engine, cancel_handlers: bool) -> None:
    aborted = engine.stats["requests_aborted"]
    async with serving(engine, cancel_handlers) as base, aiohttp.ClientSession() as session:
        post = asyncio.ensure_future(session.post(base + "/v1/completions", json={"prompt": "long", **LONG}))
        assert await wait_until(lambda: pages_in_use(engine) > 0)
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        assert await wait_until(lambda: engine.health()["requests_running"] == 0)
    assert engine.stats["requests_aborted"] == aborted + 1
    assert pages_in_use(engine) == 0


async def test_engine_stopping_mid_stream_sends_an_error_event() -> None:
    """After the headers went out an error can only be an event: SSE gets a
    `data: {"error": ...}` then `[DONE]`, NDJSON a last line with `error`."""
    async with running_engine() as engine, serving(engine) as base, aiohttp.ClientSession() as session:
        sse = await session.post(base + "/v1/completions", json={"prompt": "x", "stream": True, **LONG})
        ndjson = await session.post(base + "/generate", json={"text": "x", "stream": True, "sampling_params": LONG})
        assert await sse.content.readline() and await ndjson.content.readline()
        await engine.shutdown()
        events = (await sse.read()).decode().strip().split("\n\n")
        lines = (await ndjson.read()).decode().strip().splitlines()
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "aborted" and error["type"] == "server_error"
    last = orjson.loads(lines[-1])
    assert last["finished"] is True and last["error"]["code"] == "aborted"
