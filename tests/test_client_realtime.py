"""`mstar.client`'s realtime session when the server fails it: refused
upgrades, nothing listening, a server that goes silent (before the upgrade's
answer, before `session.created`, mid-response) and a refused
`session.update`. A stub server plays each part on demand (its `?model=`
picks which) and says when each socket closed on its side; the real server's
refusals are covered in test_client.py and test_http_access.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from http_support import serving_app

from mstar.client import AsyncClient, Client, MstarError

TIMEOUT = 0.5    # the clients' timeout here: short, so that a silence fails fast
GUARD_S = 10.0   # what a call that ignored its timeout would hang past: the test fails instead


class Stub:
    """The stub's URL and, per model, an event set once that socket closed on the server's side."""

    def __init__(self, url: str, closed: defaultdict[str, asyncio.Event]) -> None:
        self.url = url
        self.closed = closed


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    """`/v1/realtime?model=`: `busy` refuses with a 429 and Retry-After,
    `html` with a proxy's 502 page; `silent` upgrades and sends nothing;
    `strict` refuses every session.update; `slow` answers response.create
    with a text and an audio delta, then the rest 1.5 s late."""
    closed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def realtime(request: web.Request) -> web.StreamResponse:
        model = request.query.get("model", "")
        if model == "busy":
            return web.json_response({"error": {"message": "too many sessions", "type": "requests",
                                                "param": None, "code": "queue_full"}},
                                     status=429, headers={"Retry-After": "3"})
        if model == "html":
            return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        try:
            if model != "silent":
                await ws.send_json({"type": "session.created", "session": {"model": model}})
            async for msg in ws:
                kind = json.loads(msg.data)["type"]
                if model == "strict" and kind == "session.update":
                    await ws.send_json({"type": "error", "error": {
                        "type": "invalid_request_error", "code": "invalid_value", "message": "unknown voice 'bob'",
                        "param": "session.audio.output.voice"}})
                elif model == "slow" and kind == "response.create":
                    await ws.send_json({"type": "response.output_text.delta", "delta": "Hel"})
                    await ws.send_json({"type": "response.output_audio.delta", "delta": "AAE="})
                    await asyncio.sleep(1.5)
                    await ws.send_json({"type": "response.output_text.delta", "delta": "lo"})
                    await ws.send_json({"type": "response.output_audio.delta", "delta": "AgM="})
                    await ws.send_json({"type": "response.done", "response": {"id": "r1", "status": "completed"}})
        finally:
            closed[model].set()
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", realtime)
    async with serving_app(app) as url:
        yield Stub(url, closed)


async def test_a_refused_upgrade_carries_the_servers_error(stub: Stub) -> None:
    async with AsyncClient(stub.url) as client:
        with pytest.raises(MstarError) as busy:
            await client.realtime("busy")
        assert (busy.value.status, busy.value.code, busy.value.message) == (429, "queue_full", "too many sessions")
        assert busy.value.retry_after == 3.0 and busy.value.retryable
        with pytest.raises(MstarError) as proxy:
            await client.realtime("html")
    # a body that is not the server's JSON still gives its text, and the status its code
    assert (proxy.value.status, proxy.value.code) == (502, "handshake_failed")
    assert "bad gateway" in proxy.value.message


async def test_nothing_listening_is_a_connection_error() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", timeout=5) as client:
        with pytest.raises(MstarError) as e:
            await client.realtime("orpheus-tiny")
    assert (e.value.status, e.value.code) == (None, "connection_error")


async def test_a_hung_upgrade_times_out() -> None:
    """A server that accepts the connection but never answers (SIGSTOPped,
    say: the kernel still accepts) is a timeout after `timeout`."""
    hung = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = hung.sockets[0].getsockname()[1]
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", timeout=TIMEOUT) as client:
            started = time.perf_counter()
            with pytest.raises(MstarError) as e:
                await asyncio.wait_for(client.realtime("orpheus-tiny"), GUARD_S)
        assert (e.value.status, e.value.code) == (None, "timeout")
        assert TIMEOUT <= time.perf_counter() - started < 5
    finally:
        hung.close()


async def test_a_silent_server_times_out_the_connect_and_is_hung_up_on(stub: Stub) -> None:
    async with AsyncClient(stub.url, timeout=TIMEOUT) as client:
        started = time.perf_counter()
        with pytest.raises(MstarError) as e:
            await asyncio.wait_for(client.realtime("silent"), GUARD_S)
        assert e.value.code == "timeout" and time.perf_counter() - started < 5
        await asyncio.wait_for(stub.closed["silent"].wait(), 5)


async def test_a_refused_update_closes_the_socket(stub: Stub) -> None:
    async with AsyncClient(stub.url) as client:
        with pytest.raises(MstarError) as e:
            await client.realtime("strict", voice="bob")
        assert (e.value.code, e.value.param) == ("invalid_value", "session.audio.output.voice")
        # the session the caller never got is closed, not left to the garbage collector
        await asyncio.wait_for(stub.closed["strict"].wait(), 5)


async def test_a_wait_for_the_answer_times_out_and_the_session_stays_open(stub: Stub) -> None:
    async with AsyncClient(stub.url, timeout=TIMEOUT) as client, await client.realtime("slow") as rt:
        started = time.perf_counter()
        with pytest.raises(MstarError) as e:
            await asyncio.wait_for(rt.speak("Hello there."), GUARD_S)
        assert (e.value.status, e.value.code) == (None, "timeout")
        assert TIMEOUT <= time.perf_counter() - started < 1.5
        assert not stub.closed["slow"].is_set()
        rt.timeout = None  # the caller may wait on: the answer still comes
        reply = await asyncio.wait_for(rt.reply(), GUARD_S)
        assert (reply.response_id, reply.status) == ("r1", "completed")
        # what came before the wait timed out is part of the answer read on
        assert (reply.text, reply.audio) == ("Hello", bytes([0, 1, 2, 3]))


async def test_the_blocking_session_times_out_too(stub: Stub) -> None:
    def speak() -> MstarError:  # in a thread: the stub serves on this test's loop
        with Client(stub.url, timeout=TIMEOUT) as client, client.realtime("slow") as rt:
            try:
                rt.speak("Hello there.")
            except MstarError as e:
                return e
            raise AssertionError("speak outlived the client's timeout")

    error = await asyncio.wait_for(asyncio.to_thread(speak), GUARD_S)
    assert error.code == "timeout"
