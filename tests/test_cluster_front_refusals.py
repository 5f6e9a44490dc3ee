"""The front when a replica refuses a request it did not begin (429: its
waiting line is full; 503: stopping, or its engine down): a body the front
read whole goes to the next replica, counted as a retry; once every replica
refused, the client hears the last refusal as it was sent; a body streamed
in without a length, or past `REPLAYABLE_BYTES`, is never sent twice, and
its refusal reaches the client; a held body that stalls gets a 408. Stub replicas on loopback ports, no engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from http_support import serving_app

from mstar.cluster import upstream
from mstar.cluster.front import Front

ROUTE = "/v1/chat/completions"
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}).encode()


def _replica(status: int, seen: list[bytes]) -> web.Application:
    """A stand-in replica answering every POST with `status`, keeping each body it was sent."""
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def answer(request: web.Request) -> web.Response:
        seen.append(await request.read())
        if status == 200:
            return web.json_response({"served": True})
        return web.json_response({"error": {"message": f"refused with {status}", "type": "server_error",
                                            "param": None, "code": f"refused_{status}"}},
                                 status=status, headers={"Retry-After": "7"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post(ROUTE, answer)
    return app


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
        async with serving_app(Front([refusing, serving]).app()) as url:
            for _ in range(2):  # the front's first pick is the first replica: one of these meets the refusal
                async with session.post(url + ROUTE, data=BODY, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    assert await r.json() == {"served": True}
            assert served_seen == [BODY, BODY]
            assert refused_seen and all(b == BODY for b in refused_seen)
            assert await _retries(session, url) == len(refused_seen)


async def test_when_every_replica_refuses_the_client_hears_the_last_refusal() -> None:
    seen: list[bytes] = []
    async with serving_app(_replica(429, seen)) as first, serving_app(_replica(503, seen)) as second, \
            aiohttp.ClientSession() as session:
        async with serving_app(Front([first, second]).app()) as url:
            async with session.post(url + ROUTE, data=BODY) as r:
                body = await r.json()
                assert r.status in (429, 503) and body["error"]["code"] == f"refused_{r.status}"
                assert r.headers["Retry-After"] == "7"
            assert seen == [BODY, BODY]  # each replica was asked once
            assert await _retries(session, url) == 1


async def _streamed() -> AsyncIterator[bytes]:
    yield BODY[:10]
    yield BODY[10:]


@pytest.mark.parametrize("how", ["streamed without a length", "past the replayable size"])
async def test_a_body_the_front_did_not_hold_is_not_sent_again(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "past the replayable size":
        monkeypatch.setattr(upstream, "REPLAYABLE_BYTES", len(BODY) - 1)
    refused_seen: list[bytes] = []
    served_seen: list[bytes] = []
    async with serving_app(_replica(429, refused_seen)) as refusing, \
            serving_app(_replica(200, served_seen)) as serving, aiohttp.ClientSession() as session:
        async with serving_app(Front([refusing, serving]).app()) as url:
            data = _streamed() if how == "streamed without a length" else BODY
            async with session.post(url + ROUTE, data=data) as r:  # the first pick: the refusing replica
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "refused_429"
            assert refused_seen == [BODY] and served_seen == []
            assert await _retries(session, url) == 0


async def test_a_held_body_that_stalls_gets_a_408(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front reads a small body whole itself, so it bounds its arrival as a replica would."""
    monkeypatch.setattr(upstream, "BODY_TIMEOUT_S", 0.3)
    seen: list[bytes] = []
    async with serving_app(_replica(200, seen)) as replica:
        async with serving_app(Front([replica]).app()) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST {ROUTE} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(BODY)}\r\n\r\n".encode()
                         + BODY[:10])
            await writer.drain()
            head = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
            assert head.split()[1] == b"408"
            assert seen == []
