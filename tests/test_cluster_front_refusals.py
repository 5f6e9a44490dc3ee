"""The front when a replica refuses a request and says it did not begin on
it (a 429 of any code, a 503 `unavailable`): a body the front held goes to
the next replica, counted as a retry, also when a 429's own body was cut or
stalled; once every replica refused, the client hears the last refusal as
it was sent. A 503 `aborted` (work done, then cut) reaches the client and
is not sent again; nor is a body the front did not hold (streamed in
without a length, past `REPLAYABLE_BYTES` or the `HELD_BYTES` budget, or
NDJSON into speech). A held body that stalls gets a 408 and its connection
closes, and a stop's drain waits for a held body still arriving. A
websocket handshake refused so goes to the next replica too. Every front
ends holding and reading no body. Stub replicas on loopback ports,
no engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from http_support import serving_app

from mstar.cluster import held_body, upstream
from mstar.cluster.front import Front

ROUTE = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}).encode()
CODES = {429: "queue_full", 503: "unavailable"}   # what an mstar replica's admission refusals carry


def _replica(status: int, seen: list[bytes], code: str | None = None) -> web.Application:
    """A stand-in replica answering every POST with `status` (an error with
    `code`, by default its admission refusal's), keeping each body it was sent."""
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.read())
        if status == 200:
            return web.json_response({"served": True})
        return web.json_response({"error": {"message": f"refused with {status}", "type": "server_error",
                                            "param": None, "code": code or CODES[status]}},
                                 status=status, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post(ROUTE, answer)
    app.router.add_post(SPEECH, answer)
    return app


@contextlib.asynccontextmanager
async def _front(replicas: list[str], **kwargs: float) -> AsyncIterator[str]:
    """A front over `replicas` (`kwargs`: `Front`'s), served; once it stopped, it holds no body and is reading
    none."""
    front = Front(replicas, **kwargs)
    async with serving_app(front.app()) as url:
        yield url
    assert front._held == 0 and front._reading == 0


async def _retries(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith("mstar_front_retries_total")))


@pytest.mark.parametrize("status", [429, 503])
async def test_a_refused_request_goes_to_the_next_replica(status: int) -> None:
    refused_seen: list[bytes] = []
    served_seen: list[bytes] = []
    async with serving_app(_replica(status, refused_seen)) as refusing, \
            serving_app(_replica(200, served_seen)) as serving, aiohttp.ClientSession() as session:
        async with _front([refusing, serving]) as url:
            for _ in range(2):  # the front's first pick is the first replica: one of these meets the refusal
                async with session.post(url + ROUTE, data=BODY, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    assert await r.json() == {"served": True}
            assert served_seen == [BODY, BODY]
            assert refused_seen and all(b == BODY for b in refused_seen)
            assert await _retries(session, url) == len(refused_seen)


@pytest.mark.parametrize("how", ["cut", "stalled"])
async def test_a_429_whose_body_never_came_still_sends_the_request_on(how: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream, "REFUSAL_READ_S", 0.3)

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=429)
        response.content_length = 100
        await response.prepare(request)
        await response.write(b'{"error": ')
        assert request.transport is not None
        if how == "cut":
            request.transport.close()   # the answer's head came, its body never will
        else:
            await asyncio.sleep(3600)   # alive, and sends no more of it
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post(ROUTE, cut)
    served: list[bytes] = []
    async with serving_app(app, shutdown_timeout=0.2) as cutting, serving_app(_replica(200, served)) as serving, \
            aiohttp.ClientSession() as session:
        async with _front([cutting, serving]) as url:
            async with session.post(url + ROUTE, data=BODY) as r:   # the first pick: the cutting replica
                assert r.status == 200
            assert served == [BODY]


async def test_when_every_replica_refuses_the_client_hears_the_last_refusal() -> None:
    seen: list[bytes] = []
    async with serving_app(_replica(429, seen)) as first, serving_app(_replica(503, seen)) as second, \
            aiohttp.ClientSession() as session:
        async with _front([first, second]) as url:
            async with session.post(url + ROUTE, data=BODY) as r:   # the first replica, then the second
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "unavailable"
                assert r.headers["Retry-After"] == "7"
            assert seen == [BODY, BODY]  # each replica was asked once
            assert await _retries(session, url) == 1


@pytest.mark.parametrize("status, code, sent_on", [(429, "rate_limited", True), (503, "aborted", False)])
async def test_any_429_is_sent_on_and_an_aborted_503_is_the_clients(status: int, code: str, sent_on: bool) -> None:
    refused: list[bytes] = []
    served: list[bytes] = []
    async with serving_app(_replica(status, refused, code=code)) as refusing, \
            serving_app(_replica(200, served)) as serving, aiohttp.ClientSession() as session:
        async with _front([refusing, serving]) as url:
            async with session.post(url + ROUTE, data=BODY) as r:   # the first pick: the refusing replica
                assert r.status == (200 if sent_on else status)
                if not sent_on:
                    assert (await r.json())["error"]["code"] == code
            assert refused == [BODY] and served == ([BODY] if sent_on else [])
            assert await _retries(session, url) == int(sent_on)


async def _streamed() -> AsyncIterator[bytes]:
    yield BODY[:10]
    yield BODY[10:]


@pytest.mark.parametrize("how", ["streamed without a length", "past the replayable size", "past the held budget",
                                 "ndjson into speech"])
async def test_a_body_the_front_did_not_hold_is_not_sent_again(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "past the replayable size":
        monkeypatch.setattr(held_body, "REPLAYABLE_BYTES", len(BODY) - 1)
    if how == "past the held budget":
        monkeypatch.setattr(held_body, "HELD_BYTES", len(BODY) - 1)
    refused_seen: list[bytes] = []
    served_seen: list[bytes] = []
    route, headers = (SPEECH, {"Content-Type": "application/x-ndjson"}) if how == "ndjson into speech" else (ROUTE, {})
    async with serving_app(_replica(429, refused_seen)) as refusing, \
            serving_app(_replica(200, served_seen)) as serving, aiohttp.ClientSession() as session:
        async with _front([refusing, serving]) as url:
            data = _streamed() if how == "streamed without a length" else BODY
            async with session.post(url + route, data=data, headers=headers) as r:  # the first pick: the refusing one
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "queue_full"
            assert refused_seen == [BODY] and served_seen == []
            assert await _retries(session, url) == 0


async def _partial_body(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to `url` that sent a request's head and the first bytes of its body, and stalls."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {ROUTE} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
    await writer.drain()
    return reader, writer


async def test_a_held_body_that_stalls_gets_a_408_and_its_connection_closes(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[bytes] = []
    async with serving_app(_replica(200, seen)) as replica:
        async with _front([replica], body_timeout=0.3) as url:
            reader, writer = await _partial_body(url)
            t0 = time.monotonic()
            with caplog.at_level(logging.ERROR):
                answer = await asyncio.wait_for(reader.read(), 5)   # to the end: the front closes it
            writer.close()
            assert 0.2 <= time.monotonic() - t0 < 3   # the front's own deadline, not the 60 s default
            assert answer.split(b"\r\n")[0].split()[1] == b"408"
            assert b"request_timeout" in answer and b"within 0.3 s (--body-timeout)" in answer
            assert seen == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stops_drain_waits_for_a_held_body_still_arriving() -> None:
    seen: list[bytes] = []
    async with serving_app(_replica(200, seen)) as replica:
        front = Front([replica])
        async with serving_app(front.app()) as url:
            reader, writer = await _partial_body(url)
            await asyncio.sleep(0.2)   # the front is reading it
            t0 = time.monotonic()
            await front._drain(web.Application(), drain_s=0.5)
            assert time.monotonic() - t0 >= 0.45
            writer.write(BODY[10:])   # it arrives after all, and is answered
            await writer.drain()
            assert (await asyncio.wait_for(reader.readline(), 5)).split()[1] == b"200"
            writer.close()
            assert seen == [BODY]
        assert front._held == 0 and front._reading == 0


@pytest.mark.parametrize("status, code, sent_on", [(429, "queue_full", True), (503, "unavailable", True),
                                                   (503, "aborted", False), (401, "invalid_api_key", False)])
async def test_a_websocket_refused_before_it_began_goes_to_the_next_replica(status: int, code: str,
                                                                           sent_on: bool) -> None:
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def refuse(_r: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no", "type": "server_error", "param": None, "code": code}},
                                 status=status)

    async def accept(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("hello")
        await ws.close()
        return ws

    apps = []
    for handler in (refuse, accept):
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/realtime", handler)
        apps.append(app)
    async with serving_app(apps[0]) as refusing, serving_app(apps[1]) as accepting, \
            aiohttp.ClientSession() as session:
        async with _front([refusing, accepting]) as url:   # the first pick: the refusing replica
            if sent_on:
                async with session.ws_connect(f"{url}/v1/realtime") as ws:
                    assert (await ws.receive()).data == "hello"
            else:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(f"{url}/v1/realtime")
                assert refused.value.status == status
            assert await _retries(session, url) == int(sent_on)
