"""What the front passes on unchanged: a request's target as the client
encoded it (an escaped `?`, `#` or `/` stays a character of its path segment
or query value), for plain requests and websocket handshakes alike; a body
still arriving when the front stops; a head it cannot parse answered in the
replicas' JSON error shape; a client's connection closed when a replica gave up on
its body. Stub replicas on loopback ports, no
engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from http_support import serving_app
from yarl import URL

from mstar.cluster.front import Front
from mstar.cluster.serving import FrontRunner

# a model id holding a slash, a `?` and a `#`, and a query value holding `#`, `&` and `+`, each escaped
ESCAPED_PATH = "/v1/models/org%2Fa%3Fb%23c"
ESCAPED_QUERY = "/v1/realtime?model=tiny%23x&voice=a%26b%2Bc"


def _echoing_replica() -> web.Application:
    """A stand-in replica that answers with the target it received, raw and as its router reads it."""
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def echo(request: web.Request) -> web.StreamResponse:
        seen = {"raw": request.raw_path, "tail": request.match_info["tail"], "query": dict(request.query)}
        if request.headers.get("upgrade", "").lower() != "websocket":
            return web.json_response(seen)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json(seen)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def test_an_escaped_path_and_query_reach_the_replica_as_the_client_sent_them() -> None:
    async with serving_app(_echoing_replica()) as replica, aiohttp.ClientSession() as session:
        async with serving_app(Front([replica]).app()) as url:
            direct, through = [], []
            for base, seen in ((replica, direct), (url, through)):
                for target in (ESCAPED_PATH, ESCAPED_QUERY):
                    async with session.get(URL(base + target, encoded=True)) as r:
                        assert r.status == 200
                        seen.append(await r.json())
            assert through == direct
            assert through[0]["tail"] == "v1/models/org/a?b#c"
            assert through[1]["query"] == {"model": "tiny#x", "voice": "a&b+c"}


async def test_a_websocket_handshake_keeps_its_escaped_query() -> None:
    async with serving_app(_echoing_replica()) as replica, aiohttp.ClientSession() as session:
        async with serving_app(Front([replica]).app()) as url:
            async with session.ws_connect(URL(url + ESCAPED_QUERY, encoded=True)) as ws:
                seen = await ws.receive_json(timeout=10)
            assert seen["raw"] == ESCAPED_QUERY
            assert seen["query"] == {"model": "tiny#x", "voice": "a&b+c"}


async def test_a_body_still_arriving_when_the_front_stops_reaches_the_replica() -> None:
    """A request whose body is still coming in (NDJSON text streamed to the
    speech route, say) is an answer under way: the drain lets it finish, so
    the rest of its body must still be read, not dropped."""
    async def count(request: web.Request) -> web.Response:
        return web.json_response({"bytes": len(await request.read())})

    app = _echoing_replica()
    app.router.add_post("/count", count)
    async with serving_app(app) as replica, aiohttp.ClientSession() as session:
        front = Front([replica])
        front_app = front.app()
        front_app.on_shutdown.clear()   # a short drain: the test's body ends well within it
        front_app.on_shutdown.append(lambda a: front._drain(a, drain_s=5.0))
        runner = FrontRunner(front_app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://%s:%d" % runner.addresses[0][:2]
        stopping: list[asyncio.Future] = []

        async def body() -> AsyncIterator[bytes]:
            yield b"a" * 1000
            while not front.replicas[0].outstanding:   # the front has passed the request on
                await asyncio.sleep(0.01)
            stopping.append(asyncio.ensure_future(runner.cleanup()))
            await asyncio.sleep(0.2)   # the stop has begun: the front takes no new requests
            yield b"b" * 1000

        async with session.post(f"{url}/count", data=body(), timeout=aiohttp.ClientTimeout(total=20)) as r:
            assert r.status == 200 and await r.json() == {"bytes": 2000}
        await stopping[0]


async def test_a_head_the_front_cannot_parse_gets_the_replicas_json_error() -> None:
    async with serving_app(_echoing_replica()) as replica:
        runner = FrontRunner(Front([replica]).app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
            head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
            writer.close()
        finally:
            await runner.cleanup()
        assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0], head
        assert b"application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "bad_request" and error["type"] == "invalid_request_error", error


async def test_a_head_that_stalls_gets_a_408_and_a_silent_connection_is_closed() -> None:
    """The front reaches a replica only with a whole head, so it holds the head's deadline itself."""
    async with serving_app(_echoing_replica()) as replica:
        front = Front([replica])
        runner = FrontRunner(front.app(), handler_cancellation=True, header_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # no blank line: the head never ends
            head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
            writer.close()
            silent_reader, silent = await asyncio.open_connection(host, port)
            assert await asyncio.wait_for(silent_reader.read(), 10) == b""   # closed without a word
            silent.close()
            async with aiohttp.ClientSession() as session, session.get(f"http://{host}:{port}/v1/models") as r:
                assert r.status == 200   # a whole head in time still goes through
            kept_reader, kept = await asyncio.open_connection(host, port)
            for stray in (b"", b"\r\n"):   # a bare CRLF between requests is no head (RFC 9112)
                kept.write(stray)
                await asyncio.sleep(0.8 if stray else 0)
                kept.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = await asyncio.wait_for(kept_reader.readuntil(b"\r\n\r\n"), 10)
                assert answer.startswith(b"HTTP/1.1 200"), answer
                length = int(next(line.split(b":")[1] for line in answer.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await kept_reader.readexactly(length)
            kept.close()
        finally:
            await runner.cleanup()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert front.counters.own == {408: 1}   # the stalled head was answered; the silent connection was not


async def test_an_http10_client_gets_a_streamed_answer_closed_by_the_connection() -> None:
    """A replica's chunked answer reaches an HTTP/1.0 client (which has no chunked encoding) as the bytes,
    ended by the front closing the connection, as a replica answers it."""
    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for piece in (b"one ", b"two ", b"three"):
            await response.write(piece)
        await response.write_eof()
        return response

    app = _echoing_replica()
    app.router.add_get("/stream", streamed)
    async with serving_app(app) as replica, serving_app(Front([replica]).app()) as url:
        front = URL(url)
        reader, writer = await asyncio.open_connection(front.host, front.port)
        writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
        head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
        writer.close()
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower(), head
    assert body == b"one two three"


def _impatient_replica() -> web.Application:
    """A stand-in replica that reads the first bytes of a body and answers 408, closing, as a replica's
    --body-timeout does; a GET is answered 200."""
    async def post(request: web.Request) -> web.Response:
        await request.content.readany()
        response = web.json_response({"error": {"code": "request_timeout"}}, status=408)
        response.force_close()
        request.content.set_exception(TimeoutError("overdue"))   # reads no more of it, as the replica's deadline
        return response

    async def get(_r: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", post)
    app.router.add_get("/{tail:.*}", get)   # /health too
    return app


@asynccontextmanager
async def _front_over(replica: str) -> AsyncIterator[URL]:
    """A front over `replica` that lingers 1 s (aiohttp's default is 10) for a body it will not read."""
    runner = FrontRunner(Front([replica]).app(), handler_cancellation=True, lingering_time=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield URL(f"http://{host}:{port}")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_a_replica_that_gives_up_on_a_streamed_body_closes_the_clients_connection(framing: str) -> None:
    """The client is mid-body when the replica answers 408 and closes: the front's answer says the connection
    closes, and it does, so what the client sends next is never read as a request of its own."""
    head = (b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n" if framing == "chunked"
            else b"Content-Length: %d\r\n\r\nhello" % (2 << 20))   # over what the front holds: streamed through
    async with serving_app(_impatient_replica()) as replica, _front_over(replica) as front:
        reader, writer = await asyncio.open_connection(front.host, front.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower(), answer
        ending = b"0\r\n\r\n" if framing == "chunked" else b""
        writer.write(ending + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        rest = await asyncio.wait_for(reader.read(), 10)   # to the close
        writer.close()
        assert b"HTTP/1.1 200" not in rest, rest


async def test_a_client_that_sends_its_whole_body_before_reading_gets_an_early_answer() -> None:
    """A replica answers 401 without reading a large body; a client that writes all of it first (http.client
    does) still reads the 401: the front drains the body rather than resetting the connection."""
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", refuse)
    size = 8 << 20
    async with serving_app(app) as replica, _front_over(replica) as front:
        for _ in range(2):
            reader, writer = await asyncio.open_connection(front.host, front.port)
            writer.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            writer.write(b"x" * size)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 401"), answer
