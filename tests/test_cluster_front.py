"""The front address over two `orpheus-tiny` replicas, each a real engine on
its own loopback port: speech streamed through it as the replicas stream it,
requests spread over both, a realtime websocket pinned to one, `/health` and
`/metrics` of both, and a replica that goes away while the other serves on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from http_support import running_engine, serving, serving_app

from mstar.cluster.serving import FrontRunner
from mstar.cluster.front import Front
from mstar.cluster.prometheus_text import labelled, merged

on_module_loop = pytest.mark.asyncio(loop_scope="module")

SPEECH = {"model": "orpheus-tiny", "input": "Hello from the front.", "voice": "tara", "response_format": "pcm",
          "max_tokens": 35, "seed": 5}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def replicas() -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(2):
            engine = await stack.enter_async_context(running_engine("orpheus-tiny"))
            urls.append(await stack.enter_async_context(serving(engine)))
        yield urls


async def _speech(session: aiohttp.ClientSession, url: str) -> tuple[int, list[bytes]]:
    async with session.post(f"{url}/v1/audio/speech", json=SPEECH) as r:
        chunks = [data async for data, _ in r.content.iter_chunks()]
        return r.status, chunks


@on_module_loop
async def test_speech_streams_through_the_front_and_spreads_over_both(replicas: list[str]) -> None:
    front = Front(replicas)
    async with serving_app(front.app()) as url, aiohttp.ClientSession() as session:
        status, direct = await _speech(session, replicas[0])
        assert status == 200
        for _ in range(2):
            status, chunks = await _speech(session, url)
            assert status == 200
            # the same seed, the same tokens: as many samples as straight from a replica, in pieces as they came
            assert len(b"".join(chunks)) == len(b"".join(direct)) and len(chunks) > 1
        assert [r.served for r in front.replicas] == [1, 1]   # one at a time: the tie rotates
        assert all(r.outstanding == 0 for r in front.replicas)
        async with session.get(f"{url}/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "orpheus-tiny"
        async with session.get(f"{url}/health") as r:
            health = await r.json()
        assert r.status == 200 and [x["healthy"] for x in health["replicas"]] == [True, True]
        # a replica's own fields too, as their last health checks (every 2 s) found them: what reads one
        # replica's /health reads the front's
        assert health["model"] == "orpheus-tiny" and health["requests_running"] in (0, 1, 2)
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'mstar_replica_up{replica="0"} 1' in text and 'mstar_replica_up{replica="1"} 1' in text
        # the front's own count of the answers each replica began: two speeches, /v1/models, /health not counted
        assert 'mstar_front_answers_total{replica="0",code="200"}' in text and "mstar_front_retries_total 0" in text
        assert any(line.startswith("mstar_") and 'replica="1"' in line for line in text.splitlines()[2:])


@on_module_loop
async def test_a_realtime_session_is_pinned_to_one_replica(replicas: list[str]) -> None:
    front = Front(replicas)
    async with serving_app(front.app()) as url, aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/v1/realtime?model=orpheus-tiny") as ws:
            first = orjson.loads((await ws.receive()).data)
            assert first["type"] == "session.created"
            assert sorted(r.outstanding for r in front.replicas) == [0, 1]   # held for the session
        await ws.close()
        assert await _settled(front)


@on_module_loop
async def test_requests_go_to_the_replica_still_up(replicas: list[str]) -> None:
    live = replicas[1]
    async with aiohttp.ClientSession() as session:
        async with serving_app(_gone_app()) as gone:
            pass   # a port that answered once and is closed now: connections to it are refused
        front = Front([gone, live])
        async with serving_app(front.app()) as url:
            for _ in range(2):
                status, chunks = await _speech(session, url)
                assert status == 200 and b"".join(chunks)
            assert not front.replicas[0].healthy and front.replicas[1].served == 2
            async with session.get(f"{url}/health") as r:
                health = await r.json()
            assert [x["healthy"] for x in health["replicas"]] == [False, True]
        front = Front([gone])
        async with serving_app(front.app()) as url:
            async with session.post(f"{url}/v1/audio/speech", json=SPEECH) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "unavailable"


async def _settled(front: Front) -> bool:
    """Every replica's outstanding count back to 0 (a closed session's handler ends just after)."""
    for _ in range(1500):
        if all(r.outstanding == 0 for r in front.replicas):
            return True
        await asyncio.sleep(0.02)
    return False


def _gone_app() -> aiohttp.web.Application:
    return aiohttp.web.Application()


# what a replica's refusals carry (`mstar.http`: 401 with WWW-Authenticate, 429/503 with Retry-After)
REFUSAL_HEADERS = {401: {"WWW-Authenticate": "Bearer"}, 404: {}, 429: {"Retry-After": "3"},
                   503: {"Retry-After": "1"}}


def _refusal(status: int) -> dict[str, Any]:
    code = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limited", 503: "unavailable"}[status]
    return {"error": {"message": f"refused: {code}", "type": "invalid_request_error" if status < 500 else
                      "server_error", "param": None, "code": code}}


def _failing_replica() -> aiohttp.web.Application:
    """A stand-in replica: healthy, a streamed answer it abandons halfway, a websocket it closes with 4001."""
    async def health(_r: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "ok"})

    async def half(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"first part")
        request.transport.abort()   # the replica dies mid-answer
        return response

    async def socket(request: aiohttp.web.Request) -> aiohttp.web.WebSocketResponse:
        ws = aiohttp.web.WebSocketResponse(protocols=("realtime",))
        await ws.prepare(request)
        await ws.send_str("hello")
        await ws.close(code=4001, message=b"done here")
        return ws

    async def half_events(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'data: {"choices": []}\n\ndata: {"cho')   # dies in the middle of an event
        request.transport.abort()
        return response

    async def lost_socket(request: aiohttp.web.Request) -> aiohttp.web.WebSocketResponse:
        ws = aiohttp.web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("hello")
        request.transport.abort()   # no close frame: the replica is gone
        return ws

    async def refused_socket(request: aiohttp.web.Request) -> aiohttp.web.Response:
        status = int(request.query["status"])
        return aiohttp.web.json_response(_refusal(status), status=status, headers=REFUSAL_HEADERS[status])

    app = aiohttp.web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/refused-ws", refused_socket)
    app.router.add_get("/half", half)
    app.router.add_get("/half-events", half_events)
    app.router.add_get("/ws", socket)
    app.router.add_get("/lost-ws", lost_socket)
    return app


@on_module_loop
async def test_a_replica_failing_mid_answer_ends_the_answer_and_close_codes_pass() -> None:
    async with serving_app(_failing_replica()) as replica, aiohttp.ClientSession() as session:
        front = Front([replica])
        async with serving_app(front.app()) as url:
            async with session.get(f"{url}/half") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()   # not a complete-looking answer
            async with session.ws_connect(f"{url}/ws", protocols=("realtime",)) as ws:
                assert ws.protocol == "realtime"   # the replica's choice, passed back
                assert (await ws.receive()).data == "hello"
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4001
            # an event stream ends with an error event, as OpenAI's clients expect
            async with session.get(f"{url}/half-events") as r:
                body = (await r.read()).decode()
            data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"   # after the error event, as a replica's own failures end
            events = [orjson.loads(d) for d in data[:-1]]
            assert events[0] == {"choices": []} and events[-1]["error"]["code"] == "replica_failed"
            # a realtime session whose replica is lost: an error event, then close code 1011
            async with session.ws_connect(f"{url}/lost-ws") as ws:
                assert (await ws.receive()).data == "hello"
                event = orjson.loads((await ws.receive()).data)
                assert event["type"] == "error" and event["error"]["code"] == "replica_failed"
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.INTERNAL_ERROR
            # a handshake the replica refuses: its status, body and headers, as the replica sent them
            for status, headers in REFUSAL_HEADERS.items():
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(f"{url}/refused-ws?status={status}")
                assert refused.value.status == status
                async with session.get(f"{url}/refused-ws?status={status}",
                                       headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                                "Sec-WebSocket-Version": "13",
                                                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}) as r:
                    assert r.status == status and await r.json() == _refusal(status)
                    assert {k: r.headers.get(k) for k in headers} == headers
            assert all(r.healthy for r in front.replicas)   # a refusal is an answer: the replica is up
            assert await _settled(front)


def _stub_replica(**routes: Any) -> aiohttp.web.Application:
    """A replica answering `/health` and GET `/<name>` with each handler given."""
    async def health(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "ok"})

    app = aiohttp.web.Application()
    app.router.add_get("/health", health)
    for name, handler in routes.items():
        app.router.add_get(f"/{name}", handler)
    return app


async def _endless_events(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(10_000):
        await response.write(b'data: {"n": %d}\n\n' % i)
        await asyncio.sleep(0.02)
    return response


async def _echo(request: aiohttp.web.Request) -> aiohttp.web.WebSocketResponse:
    ws = aiohttp.web.WebSocketResponse()
    await ws.prepare(request)
    async for msg in ws:
        await ws.send_str(msg.data)
    return ws


async def _front_to_stop(replica: str, drain_s: float) -> tuple[FrontRunner, str]:
    """A front over `replica` as `python -m mstar.cluster.front` serves it, with a drain of `drain_s`."""
    front = Front([replica])
    app = front.app()
    app.on_shutdown.clear()
    app.on_shutdown.append(lambda a: front._drain(a, drain_s=drain_s))
    runner = FrontRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, "http://%s:%d" % runner.addresses[0][:2]


@on_module_loop
async def test_a_stopping_front_drains_then_ends_event_streams_with_an_error_event() -> None:
    """The front's stop, as a replica's: an answer under way runs on for the
    drain, then its event stream ends with an error event and [DONE] (not a
    cut), within the grace."""
    async with serving_app(_stub_replica(events=_endless_events)) as replica, aiohttp.ClientSession() as session:
        runner, url = await _front_to_stop(replica, 0.5)
        async with session.get(f"{url}/events") as r:
            assert (await r.content.readline()).startswith(b"data: ")
            started = asyncio.get_running_loop().time()
            stopping = asyncio.ensure_future(runner.cleanup())
            body = (await r.read()).decode()
        await stopping
        took = asyncio.get_running_loop().time() - started
        data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and orjson.loads(data[-2])["error"]["code"] == "aborted"
        assert orjson.loads(data[-3])["n"] > 10   # it ran on through the drain
        assert 0.5 <= took < 5, took


@on_module_loop
async def test_a_websocket_through_a_stopping_front_is_heard_until_the_drain_closes_it() -> None:
    """A realtime client's message during the front's drain (a cancel, say)
    reaches the replica and its answer comes back; then the socket closes 1001."""
    async with serving_app(_stub_replica(echo=_echo)) as replica, aiohttp.ClientSession() as session:
        runner, url = await _front_to_stop(replica, 1.0)
        async with session.ws_connect(f"{url}/echo") as ws:
            await ws.send_str("before")
            assert (await ws.receive(timeout=10)).data == "before"
            stopping = asyncio.ensure_future(runner.cleanup())
            await asyncio.sleep(0.3)   # the drain is under way
            await ws.send_str("during")
            assert (await ws.receive(timeout=10)).data == "during"
            closed = await ws.receive(timeout=10)
            assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == aiohttp.WSCloseCode.GOING_AWAY
        await stopping


def test_metrics_lines_get_the_replica_label_and_families_merge() -> None:
    text = "# HELP a x\n# TYPE a counter\na 3\nb{k=\"v\"} 1.5\n"
    assert labelled(text, 2).splitlines() == ["# HELP a x", "# TYPE a counter", 'a{replica="2"} 3',
                                              'b{replica="2",k="v"} 1.5']
    both = merged([labelled(text, 0), labelled(text, 1)]).splitlines()
    assert both == ["# HELP a x", "# TYPE a counter", 'a{replica="0"} 3', 'b{replica="0",k="v"} 1.5',
                    'a{replica="1"} 3', 'b{replica="1",k="v"} 1.5']
