"""The front when its replicas fail: a websocket that could not reach one
goes to the next; a replica that drops a request it took is marked down and
the client told (502, not sent again); a hung replica bounded by the read
timeout (504, an error event mid-stream) while a stream that keeps
producing runs on; `/metrics` not held by a hung replica and a replica's
401 passed on; close codes and reasons relayed; `/health`'s 503 says when to
ask again; the stop bounded. Stub replicas on loopback ports, no engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import aiohttp
import pytest
from aiohttp import web
from http_support import read_sse, serving_app

from mstar.cluster import front as front_module
from mstar.cluster.front import WS_MAX_MESSAGE, Front

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _replica(**routes: Handler) -> web.Application:
    """A stand-in replica: `/health`, and each handler at `/<name>` (GET and POST)."""
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    for name, handler in routes.items():
        app.router.add_route("*", f"/{name}", handler)
    return app


def _serve(app: web.Application) -> AbstractAsyncContextManager[str]:
    """A stand-in replica served; its stop cuts a handler left hanging at once."""
    return serving_app(app, shutdown_timeout=0.2)


async def _gone() -> str:
    """A port that answered once and is closed now: connections to it are refused."""
    async with serving_app(web.Application()) as url:
        pass
    return url


async def _echo(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    async for msg in ws:
        await ws.send_str(msg.data)
    return ws


async def _ok(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _dies_after_the_body(request: web.Request) -> web.Response:
    await request.read()   # the whole request arrived; then the replica dies before it answers
    assert request.transport is not None
    request.transport.abort()
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def _hangs(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(3600)   # alive, silent: what a SIGSTOPped replica looks like from the front
    raise AssertionError("unreachable")


async def _hangs_socket(_request: web.Request) -> web.Response:
    await asyncio.sleep(3600)   # a handshake never answered
    raise AssertionError("unreachable")


async def _slow_events(request: web.Request) -> web.StreamResponse:
    """Ten events 0.2 s apart (2 s in all), then a stop: the last one never comes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(10):
        await response.write(b'data: {"n": %d}\n\n' % i)
        await asyncio.sleep(0.2)
    if request.query.get("then") == "hang":
        await asyncio.sleep(3600)
    await response.write(b"data: [DONE]\n\n")
    return response


async def _checked(front: Front) -> None:
    """The front's first health checks are done (a dead replica is marked down by then)."""
    for _ in range(500):
        if not all(r.healthy for r in front.replicas):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no replica was found down")


async def _settled(front: Front) -> None:
    for _ in range(500):
        if all(r.outstanding == 0 for r in front.replicas):
            return
        await asyncio.sleep(0.02)
    raise AssertionError([r.outstanding for r in front.replicas])


# ---------------------------------------------------------------- unreachable, dropped, hung


async def test_a_websocket_goes_on_to_a_live_replica_and_the_dead_one_is_marked_down() -> None:
    gone = await _gone()
    async with _serve(_replica(echo=_echo)) as live, aiohttp.ClientSession() as session:
        front = Front([gone, live])
        async with serving_app(front.app()) as url:
            await _checked(front)
            front.replicas[0].healthy = True   # it died since its last check: the first pick is this one
            async with session.ws_connect(f"{url}/echo") as ws:
                await ws.send_str("hello")
                assert (await ws.receive(timeout=10)).data == "hello"
            assert [r.healthy for r in front.replicas] == [False, True]
            assert [r.served for r in front.replicas] == [0, 1]
            await _settled(front)


async def test_a_websocket_handshake_a_hung_replica_never_answers_goes_on_to_the_next() -> None:
    async with _serve(_replica(echo=_hangs_socket)) as hung, _serve(_replica(echo=_echo)) as live, \
            aiohttp.ClientSession() as session:
        front = Front([hung, live], replica_timeout=0.5)
        async with serving_app(front.app()) as url:
            async with session.ws_connect(f"{url}/echo") as ws:
                await ws.send_str("hi")
                assert (await ws.receive(timeout=10)).data == "hi"
            assert [r.healthy for r in front.replicas] == [False, True]
            await _settled(front)


async def test_a_replica_that_drops_a_request_it_took_is_marked_down_and_the_client_told() -> None:
    async with _serve(_replica(work=_dies_after_the_body)) as dying, _serve(_replica(work=_ok)) as live, \
            aiohttp.ClientSession() as session:
        front = Front([dying, live])
        async with serving_app(front.app()) as url:
            async with session.post(f"{url}/work", json={"prompt": "x" * 1000}) as r:
                body = await r.json()
            assert r.status == 502 and body["error"]["code"] == "replica_failed", body
            assert set(body["error"]) == {"message", "type", "param", "code"}
            # not sent again: the replica that took it may have begun on it
            assert [r.healthy for r in front.replicas] == [False, True]
            assert front.replicas[1].served == 0
            # the next request goes to the replica still up
            async with session.post(f"{url}/work", json={}) as r:
                assert r.status == 200 and await r.json() == {"ok": True}
            await _settled(front)


async def test_a_bodiless_get_a_replica_dropped_goes_on_to_the_next() -> None:
    async with _serve(_replica(work=_dies_after_the_body)) as dying, _serve(_replica(work=_ok)) as live, \
            aiohttp.ClientSession() as session:
        front = Front([dying, live])
        async with serving_app(front.app()) as url:
            async with session.get(f"{url}/work") as r:   # no effects: safe to send again
                assert r.status == 200 and await r.json() == {"ok": True}
            assert [r.healthy for r in front.replicas] == [False, True]


async def test_a_hung_replica_gives_504_not_a_hang() -> None:
    async with _serve(_replica(work=_hangs)) as hung, aiohttp.ClientSession() as session:
        front = Front([hung], replica_timeout=0.5)
        async with serving_app(front.app()) as url:
            started = time.monotonic()
            async with session.post(f"{url}/work", json={}, timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.json()
            assert r.status == 504 and body["error"]["code"] == "replica_timeout", body
            assert time.monotonic() - started < 5
            # silence alone leaves it up (a busy replica's answer can take long): its health check decides
            await _settled(front)


async def test_a_bodiless_get_every_replica_leaves_unanswered_gives_504_not_unavailable() -> None:
    """Sent again to the next replica (it has no effects), then out of replicas: the client hears that they went
    silent, as a POST does, not that none was available (/health still lists them up)."""
    async with _serve(_replica(work=_hangs)) as a, _serve(_replica(work=_hangs)) as b, \
            aiohttp.ClientSession() as session:
        front = Front([a, b], replica_timeout=0.3)
        async with serving_app(front.app()) as url:
            async with session.get(f"{url}/work", timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.json()
            assert r.status == 504 and body["error"]["code"] == "replica_timeout", body
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            # the front's own counters: its 504, and the one request sent on to the second replica
            assert 'mstar_front_own_answers_total{code="504"} 1' in text and "mstar_front_retries_total 1" in text
            await _settled(front)


async def test_a_stream_that_keeps_producing_outlives_the_read_timeout_and_one_that_stops_does_not() -> None:
    async with _serve(_replica(events=_slow_events)) as replica, aiohttp.ClientSession() as session:
        front = Front([replica], replica_timeout=0.6)   # under the stream's 2 s, over its 0.2 s gaps
        async with serving_app(front.app()) as url:
            async with session.get(f"{url}/events") as r:
                events = await read_sse(r)
            assert events == [{"n": i} for i in range(10)] + ["[DONE]"]
            async with session.get(f"{url}/events?then=hang", timeout=aiohttp.ClientTimeout(total=10)) as r:
                events = await read_sse(r)
            assert events[:10] == [{"n": i} for i in range(10)] and events[-1] == "[DONE]"
            assert events[10]["error"]["code"] == "replica_timeout"
            await _settled(front)


def test_the_replica_timeout_is_a_flag_of_both_commands() -> None:
    from mstar.cluster.__main__ import parse

    a, rest = parse(["--replica-timeout", "42", "--", "--model", "tiny-llama"])
    assert a.replica_timeout == 42 and rest == ["--model", "tiny-llama"]   # not passed on to the replicas
    assert parse([])[0].replica_timeout == front_module.REPLICA_TIMEOUT_S
    for module in ("mstar.cluster.front", "mstar.cluster"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True)
        assert "--replica-timeout" in out.stdout and "--header-timeout" in out.stdout
    with pytest.raises(ValueError):
        Front(["http://127.0.0.1:1"], replica_timeout=0)


def test_the_body_timeout_is_the_fronts_and_the_replicas() -> None:
    """`python -m mstar.cluster --body-timeout S` bounds the bodies the front holds and, as it did before the
    front held any, the replicas' own; after `--` it is the replicas' alone."""
    from mstar.cluster.__main__ import parse
    from mstar.cluster.held_body import BODY_TIMEOUT_S

    a, rest = parse(["--body-timeout", "120", "--", "--model", "tiny-llama"])
    assert a.body_timeout == 120 and rest == ["--body-timeout=120.0", "--model", "tiny-llama"]
    a, rest = parse(["--body-time", "5"])   # an abbreviation is a replica's flag, as before the front held bodies
    assert a.body_timeout == BODY_TIMEOUT_S and rest == ["--body-time", "5"]
    a, rest = parse(["--", "--body-timeout", "5"])
    assert a.body_timeout == BODY_TIMEOUT_S and rest == ["--body-timeout", "5"]
    assert parse(["--body-timeout=0"])[0].body_timeout == 0   # no limit, as a replica's 0
    with pytest.raises(ValueError):
        Front(["http://127.0.0.1:1"], body_timeout=-1)


@pytest.mark.parametrize(("flags", "says"), [
    (["--replicas", "http://127.0.0.1:1", "--replica-timeout", "nan"], "--replica-timeout must be a positive"),
    (["--replicas", "http://127.0.0.1:1", "--replica-timeout", "inf"], "--replica-timeout must be a positive"),
    (["--replicas", "http://127.0.0.1:1", "--replica-timeout", "0"], "--replica-timeout must be a positive"),
    (["--replicas", "http://127.0.0.1:1", "--body-timeout", "-1"], "--body-timeout must be a finite number"),
    (["--replicas", "http://127.0.0.1:1", "--body-timeout", "inf"], "--body-timeout must be a finite number"),
    (["--replicas", " , "], "--replicas names no replica"),
])
def test_the_fronts_bad_flags_are_one_line_not_a_traceback(flags: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "mstar.cluster.front", *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "mstar front over" not in out.stdout  # nothing claims it serves
    with pytest.raises(SystemExit):
        from mstar.cluster.__main__ import parse
        parse(["--replica-timeout", "nan"])


def test_a_taken_port_is_one_line_not_a_traceback() -> None:
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "mstar.cluster.front", "--replicas", "http://127.0.0.1:1",
                              "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"error: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "mstar front over" not in out.stdout


# ---------------------------------------------------------------- /metrics and /health


async def test_metrics_are_not_held_by_a_hung_replica() -> None:
    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(text="# HELP x a\n# TYPE x counter\nx 1\n")

    async with _serve(_replica(metrics=_hangs)) as hung, _serve(_replica(metrics=metrics)) as live, \
            aiohttp.ClientSession() as session:
        front = Front([hung, live])
        async with serving_app(front.app()) as url:
            started = time.monotonic()
            async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
            assert time.monotonic() - started < front_module.METRICS_TIMEOUT_S + 1.5
            assert r.status == 200
            assert 'mstar_replica_up{replica="0"} 0' in text and 'mstar_replica_up{replica="1"} 1' in text
            assert 'x{replica="1"} 1' in text


async def test_metrics_a_replica_refuses_for_its_key_answer_with_its_refusal() -> None:
    async def keyed(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": {"message": "bad key", "type": "invalid_request_error",
                                                "param": None, "code": "invalid_api_key"}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return web.Response(text="# HELP x a\n# TYPE x counter\nx 1\n")

    async with _serve(_replica(metrics=keyed)) as a, _serve(_replica(metrics=keyed)) as b, \
            aiohttp.ClientSession() as session:
        front = Front([a, b])
        async with serving_app(front.app()) as url:
            async with session.get(f"{url}/metrics") as r:
                body = await r.json()
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert body["error"]["code"] == "invalid_api_key"
            async with session.get(f"{url}/metrics", headers={"Authorization": "Bearer k"}) as r:
                text = await r.text()
            assert r.status == 200 and 'mstar_replica_up{replica="0"} 1' in text
            assert 'mstar_replica_up{replica="1"} 1' in text


async def test_health_with_every_replica_down_says_when_to_ask_again() -> None:
    front = Front([await _gone()])
    front.replicas[0].healthy = False
    async with serving_app(front.app()) as url, aiohttp.ClientSession() as session:
        async with session.get(f"{url}/health") as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["status"] == "unavailable"


# ---------------------------------------------------------------- websocket closes


async def test_a_replica_close_code_and_reason_reach_the_client() -> None:
    async def closes(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        await ws.close(code=aiohttp.WSCloseCode.MESSAGE_TOO_BIG, message=b"a client event may be at most 10 bytes")
        return ws

    async with _serve(_replica(ws=closes)) as replica, aiohttp.ClientSession() as session:
        front = Front([replica])
        async with serving_app(front.app()) as url:
            async with session.ws_connect(f"{url}/ws") as ws:
                await ws.send_str("too long for it")
                msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.CLOSE
            assert (msg.data, msg.extra) == (aiohttp.WSCloseCode.MESSAGE_TOO_BIG,
                                             "a client event may be at most 10 bytes")
            await _settled(front)


async def test_a_message_over_the_limit_closes_1009_with_a_reason_not_a_reset() -> None:
    async with _serve(_replica(echo=_echo)) as replica, aiohttp.ClientSession() as session:
        front = Front([replica])
        async with serving_app(front.app()) as url:
            async with session.ws_connect(f"{url}/echo") as ws:
                await ws.send_bytes(b"x" * (WS_MAX_MESSAGE + 1))   # the client is still sending as the front refuses
                msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
            assert str(WS_MAX_MESSAGE) in msg.extra
            await _settled(front)


# ---------------------------------------------------------------- the stop


def test_the_stop_budget_fits_the_grace() -> None:
    f = front_module
    assert f.DRAIN_S + f.END_S + 2 * f.SHUTDOWN_TIMEOUT_S + f.EXIT_S <= f.GRACE_S


def test_a_stop_that_will_not_end_is_cut_at_its_bound() -> None:
    """`serving.run`'s bound: an app whose shutdown never ends is cut at
    `stop_within_s` after the signal, not waited on."""
    script = textwrap.dedent("""
        import asyncio, os, signal, threading
        from aiohttp import web
        from mstar.cluster import serving

        async def stuck(_app):
            await asyncio.sleep(3600)

        app = web.Application()
        app.on_shutdown.append(stuck)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        serving.run(app, host="127.0.0.1", port=0, backlog=8, shutdown_timeout=0.1, stop_within_s=1.0)
        print("stopped", flush=True)
    """)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert out.returncode == 0 and "stopped" in out.stdout, out.stderr
    assert took < 6, took


async def test_the_drain_does_not_wait_on_a_websocket_client_that_never_answers_its_close() -> None:
    async with _serve(_replica(echo=_echo)) as replica, aiohttp.ClientSession() as session:
        front = Front([replica])
        app = front.app()
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=front_module.SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://%s:%d" % runner.addresses[0][:2]
        deaf = [await session.ws_connect(f"{url}/echo", autoclose=False) for _ in range(3)]   # never read
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await front._drain(app, drain_s=0.1)
        assert time.monotonic() - started < 0.1 + front_module.END_S + 0.5
        await runner.cleanup()
        for ws in deaf:
            await ws.close()


async def test_the_front_pings_a_quiet_websocket_client_as_a_replica_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's pings stop at the front (its upstream socket answers them),
    so the front pings its clients itself: a client that reads a quiet session
    with a timeout sees the peer alive, as it would talking to a replica."""
    monkeypatch.setattr(front_module, "HEARTBEAT_S", 0.2)
    async with _serve(_replica(echo=_echo)) as live, aiohttp.ClientSession() as session:
        front = Front([live])
        async with serving_app(front.app()) as url:
            async with session.ws_connect(f"{url}/echo", autoping=False) as ws:
                assert (await ws.receive(timeout=5)).type == aiohttp.WSMsgType.PING
            await _settled(front)
