"""What the front passes on unchanged: a request's target as the client
encoded it (an escaped `?`, `#` or `/` stays a character of its path segment
or query value), for plain requests and websocket handshakes alike. Stub
replicas on loopback ports, no engine."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from http_support import serving_app
from yarl import URL

from mstar.cluster.front import Front

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
