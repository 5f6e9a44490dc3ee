"""`--api-key` and `--allowed-origins` on a real tiny-llama server: every route
but /health and the demo's files wants the bearer key (the realtime websocket
also takes it as the browser subprotocol), a refusal is an OpenAI-shaped 401
with WWW-Authenticate; CORS answers preflights and marks answers for allowed
origins only; the SDK sends the key; the flags and the env var parse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from http_support import serving_app

from mstar.client import AsyncClient, Client, MstarError
from mstar.config import ServerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.errors import ConfigError
from mstar.http.access import key_matches
from mstar.http.server import build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-test-0123456789"
ORIGIN = "https://app.example"
BEARER = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}


def serve(engine: Engine, **config: object):
    return serving_app(build_app(engine, manage_engine=False, config=ServerConfig(**config)),
                       handler_cancellation=True, access_log=None, shutdown_timeout=1.0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url(engine: Engine) -> AsyncIterator[str]:
    async with serve(engine, api_key=KEY, allowed_origins=(ORIGIN,)) as u:
        yield u


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def realtime_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/realtime"


# ------------------------------------------------------------------- the key

@pytest.mark.parametrize("path", ["/health", "/", "/static/demo.js"])
async def test_health_and_the_demo_stay_open(url: str, http: aiohttp.ClientSession, path: str) -> None:
    async with http.get(url + path) as r:
        assert r.status == 200, path


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                                         ("POST", "/v1/completions"), ("POST", "/generate"),
                                         ("GET", "/no/such/route")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer"])
async def test_every_other_route_wants_the_key(url: str, http: aiohttp.ClientSession, method: str, path: str,
                                               auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    async with http.request(method, url + path, json=COMPLETION if method == "POST" else None,
                            headers=headers) as r:
        assert r.status == 401
        assert r.headers["WWW-Authenticate"] == "Bearer"
        error = (await r.json())["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert ("no API key" if auth in (None, f"Basic {KEY}", "Bearer") else "not valid") in error["message"]
    assert KEY not in error["message"]


async def test_the_key_lets_requests_through(url: str, http: aiohttp.ClientSession) -> None:
    async with http.get(url + "/v1/models", headers=BEARER) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny-llama"
    async with http.post(url + "/v1/completions", json=COMPLETION, headers={"Authorization": f"bearer {KEY}"}) as r:
        assert r.status == 200 and (await r.json())["object"] == "text_completion"


async def test_realtime_is_refused_before_the_upgrade(url: str, http: aiohttp.ClientSession) -> None:
    for kwargs in ({}, {"headers": {"Authorization": "Bearer nope"}},
                   {"protocols": ("realtime", "openai-insecure-api-key.nope")}):
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await http.ws_connect(realtime_url(url), **kwargs)
        assert e.value.status == 401


async def test_realtime_takes_the_bearer_header(url: str, http: aiohttp.ClientSession) -> None:
    async with http.ws_connect(realtime_url(url), headers=BEARER) as ws:
        assert (await ws.receive_json())["type"] == "session.created"


async def test_realtime_takes_the_browser_subprotocol(url: str, http: aiohttp.ClientSession) -> None:
    # what a browser sends: new WebSocket(url, ["realtime", "openai-insecure-api-key." + key])
    async with http.ws_connect(realtime_url(url), protocols=("realtime", f"openai-insecure-api-key.{KEY}")) as ws:
        assert ws.protocol == "realtime"  # a browser fails a handshake that picks none of its offers
        assert (await ws.receive_json())["type"] == "session.created"


async def test_the_subprotocol_counts_only_on_a_websocket_upgrade(url: str, http: aiohttp.ClientSession) -> None:
    async with http.get(url + "/v1/models", headers={"Sec-WebSocket-Protocol": f"openai-insecure-api-key.{KEY}"}) as r:
        assert r.status == 401


async def test_keys_compare_whole_and_beyond_ascii() -> None:
    assert key_matches("clé-1", "clé-1")
    assert not key_matches("clé-1", "clé-2") and not key_matches("clé", "clé-1") and not key_matches("", "k")


async def test_a_key_that_is_not_utf8_is_a_401_not_a_fault(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xed\r\n"
                 b"Connection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


# ------------------------------------------------------------------------ SDK

async def test_the_async_client_sends_its_key(url: str) -> None:
    async with AsyncClient(url, api_key=KEY) as client:
        assert [m.id for m in await client.models()] == ["tiny-llama"]
        assert (await client.completions("Hello", max_tokens=2)).text is not None
        async with await client.realtime("tiny-llama") as session:
            assert session.session["model"] == "tiny-llama"
    async with AsyncClient(url) as client:
        with pytest.raises(MstarError) as http_error:
            await client.models()
        assert http_error.value.status == 401 and http_error.value.code == "invalid_api_key"
        with pytest.raises(MstarError) as e:
            await client.realtime("tiny-llama")
        # the refused upgrade says what the HTTP answer says, read from its body
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
        assert e.value.message == http_error.value.message


async def test_the_blocking_client_sends_its_key(url: str) -> None:
    def calls() -> None:  # in a thread: the server runs on this test's loop
        with Client(url, api_key=KEY) as client:
            assert client.models()[0].id == "tiny-llama"
        with Client(url, api_key="wrong") as client, pytest.raises(MstarError) as e:
            client.models()
        assert e.value.status == 401

    await asyncio.to_thread(calls)


async def _expect_answer(url: str, head: bytes, body: bytes | None = None) -> bytes:
    """What the server says to a head carrying `Expect: 100-continue`, before the body is sent (then the
    rest, once `body` goes)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        got = await asyncio.wait_for(reader.read(65536), 10)
        if body is not None and got.startswith(b"HTTP/1.1 100 "):
            writer.write(body)
            got += await asyncio.wait_for(reader.read(65536), 30)
        return got
    finally:
        writer.close()


@pytest.mark.parametrize(("key", "length", "status"), [(None, 100, b"401"), ("wrong", 100, b"401"),
                                                        (KEY, 33 * 2**20, b"413")])
async def test_a_body_that_would_be_refused_is_refused_before_it_is_sent(
        url: str, key: str | None, length: int, status: bytes) -> None:
    """`Expect: 100-continue` (curl sends it for bodies over 1 MB) asks whether to send the body: the
    server said yes before checking the key or the length, so the client uploaded up to 32 MiB for a 401."""
    auth = b"" if key is None else b"Authorization: Bearer %s\r\n" % key.encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (auth, length))
    answer = await _expect_answer(url, head)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert b"100 Continue" not in answer and b"application/json" in answer
    assert b"X-Request-Id: " in answer  # refused by the middlewares, so logged as every other request


async def _all_answers(url: str, *sent: bytes) -> list[bytes]:
    """What the server says on one connection after each of `sent` (each read until it pauses 1 s or closes)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    answers = []
    try:
        for data in sent:
            with contextlib.suppress(ConnectionError):
                writer.write(data)
            got = b""
            with contextlib.suppress(TimeoutError, ConnectionError):
                while chunk := await asyncio.wait_for(reader.read(65536), 1.0):
                    got += chunk
            answers.append(got)
        return answers
    finally:
        writer.close()


async def test_a_refusal_before_the_body_closes_its_connection(url: str) -> None:
    """The refused request's body never comes: read on, the next request on the connection would be taken
    for it (a GET's bytes as the POST's body, the rest a 400). The refusal says it closes, and does."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer wrong\r\nContent-Length: 20\r\nExpect: 100-continue\r\n\r\n")
    refused, after = await _all_answers(url, head, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 401 ") and b"Connection: close" in refused, refused[:400]
    assert after == b"", after[:400]


async def test_a_route_that_asks_at_once_says_100_continue_once(url: str) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    [answer] = await _all_answers(url, head)
    assert answer.count(b"100 Continue") == 1 and b"HTTP/1.1 200 " in answer, answer[:400]


async def test_a_body_that_is_welcome_is_asked_for(url: str) -> None:
    body = b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
            b"Bearer %s\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (KEY.encode(), len(body)))
    answer = await _expect_answer(url, head, body)
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), answer[:200]


# ----------------------------------------------------------------------- CORS

async def test_a_preflight_is_answered_without_the_key(url: str, http: aiohttp.ClientSession) -> None:
    async with http.options(url + "/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}) as r:
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        allowed = {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed
        assert "Origin" in r.headers.getall("Vary")


async def test_a_preflight_allows_the_headers_the_openai_sdk_sends(url: str, http: aiohttp.ClientSession) -> None:
    """The `openai` JS SDK in a browser sends X-Stainless-* headers on every call: a preflight that named only
    Authorization and Content-Type made the browser drop each request before it left."""
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count, openai-organization"
    async with http.options(url + "/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}) as r:
        assert r.status == 204
        allowed = {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
        assert {h.strip() for h in asked.split(",")} <= allowed
        assert {"authorization", "content-type"} <= allowed
        assert "Access-Control-Request-Headers" in ", ".join(r.headers.getall("Vary"))
    async with http.options(url + "/v1/chat/completions", headers={  # a name no header can have is not echoed
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, bad name"}) as r:
        assert r.status == 204
        assert "bad name" not in r.headers["Access-Control-Allow-Headers"]


async def test_a_preflight_from_another_origin_is_refused(url: str, http: aiohttp.ClientSession) -> None:
    async with http.options(url + "/v1/models", headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "GET"}) as r:
        assert r.status == 403
        assert "Access-Control-Allow-Origin" not in r.headers
        assert (await r.json())["error"]["param"] == "Origin"


async def test_answers_to_an_allowed_origin_carry_allow_origin(url: str, http: aiohttp.ClientSession) -> None:
    cors = {"Origin": ORIGIN}
    async with http.get(url + "/v1/models", headers={**BEARER, **cors}) as r:
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
    async with http.get(url + "/v1/models", headers=cors) as r:  # the browser may read why it was refused
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    async with http.post(url + "/v1/completions", json={**COMPLETION, "stream": True},
                         headers={**BEARER, **cors}) as r:  # streamed: the headers went out before the body
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
        await r.read()
    async with http.get(url + "/health", headers={"Origin": "https://evil.example"}) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_any_origin_with_a_star(engine: Engine, http: aiohttp.ClientSession) -> None:
    async with serve(engine, allowed_origins=("*",)) as u:
        async with http.options(u + "/v1/models", headers={"Origin": "https://x.example",
                                                           "Access-Control-Request-Method": "GET"}) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
        async with http.get(u + "/v1/models", headers={"Origin": "https://y.example"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"


async def test_no_origins_no_cors_and_no_key_no_check(engine: Engine, http: aiohttp.ClientSession) -> None:
    async with serve(engine) as u:
        async with http.get(u + "/v1/models", headers={"Origin": ORIGIN}) as r:
            assert r.status == 200
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
        async with http.options(u + "/v1/models", headers={"Origin": ORIGIN,
                                                           "Access-Control-Request-Method": "GET"}) as r:
            assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers


async def test_a_refused_origin_still_varies_by_origin(url: str, http: aiohttp.ClientSession) -> None:
    async with http.get(url + "/v1/models", headers={**BEARER, "Origin": "https://evil.example"}) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        assert "Origin" in r.headers.getall("Vary")


async def _socket_status(http: aiohttp.ClientSession, url: str, **kwargs: object) -> int:
    try:
        async with http.ws_connect(realtime_url(url), **kwargs) as ws:
            await ws.close()
            return 101
    except aiohttp.WSServerHandshakeError as e:
        return e.status


async def test_a_websocket_from_a_page_of_another_origin_is_refused(engine: Engine, url: str,
                                                                    http: aiohttp.ClientSession) -> None:
    """Browsers apply no CORS to websockets: the server checks the Origin."""
    assert await _socket_status(http, url, headers=BEARER, origin=ORIGIN) == 101
    assert await _socket_status(http, url, headers=BEARER, origin="https://evil.example") == 403
    async with serve(engine) as open_server:  # no key, no origins: a server on the user's own machine
        host = open_server.removeprefix("http://")
        assert await _socket_status(http, open_server) == 101  # no browser: no Origin
        assert await _socket_status(http, open_server, origin=f"http://{host}") == 101  # its own demo page
        assert await _socket_status(http, open_server, origin="https://evil.example") == 403


# --------------------------------------------------------------------- flags

async def test_the_flags_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSTAR_API_KEY", raising=False)
    config = parse_args(["--api-key", "k1", "--allowed-origins", f"{ORIGIN}, http://localhost:3000,",
                         "--header-timeout", "5", "--body-timeout", "0"])
    assert config.api_key == "k1"
    assert config.allowed_origins == (ORIGIN, "http://localhost:3000")
    assert (config.header_timeout, config.body_timeout) == (5.0, 0.0)
    default = parse_args([])
    assert (default.api_key, default.allowed_origins, default.header_timeout, default.body_timeout) == \
        (None, (), 10.0, 60.0)
    monkeypatch.setenv("MSTAR_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "flag-wins"]).api_key == "flag-wins"
    with pytest.raises(ConfigError, match="--header-timeout"):
        parse_args(["--header-timeout", "-1"])
