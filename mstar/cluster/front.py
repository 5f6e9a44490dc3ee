"""The front address of several mstar replicas: every HTTP request in, passed
to one replica and its answer streamed back as it comes; a websocket
(`/v1/realtime`) pinned to one replica for its whole session.

Routing takes the healthy replica with the fewest requests outstanding (the
rule of in-process replicas), the one after the last pick on a tie. A replica
that refuses a connection, or whose `/health` stops answering, is marked down
and left out until its health check passes again; a request that could not
reach one is tried on the next, since it never started there. A replica that
fails after it began answering cuts that answer short: the client sees the
stream end early (a plain answer: 502), never a silent retry that could speak
twice. `/health` lists the replicas; `/metrics` is each replica's, every
sample labelled `replica="<index>"`.

Bodies pass through unbuffered both ways (NDJSON input streamed to the
speech route included), so the front adds one hop per chunk, not a wait for
whole responses.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence, Set
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

log = structlog.get_logger("mstar.cluster.front")

HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0
# headers that describe one hop's connection, not the message (RFC 9110 7.6.1), and those aiohttp sets itself
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length"})


@dataclass(eq=False)
class Replica:
    """One replica's base URL and what the front knows of it."""

    url: str
    index: int
    healthy: bool = True
    outstanding: int = 0
    served: int = 0


class NoReplica(Exception):
    """No healthy replica could take the request."""


class Front:
    """The replicas behind one address; `app()` serves them."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a front needs at least one replica")
        self.replicas = [Replica(url.rstrip("/"), i) for i, url in enumerate(urls)]
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._checker: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ routing

    def pick(self, exclude: Set[int] = frozenset()) -> Replica:
        """The healthy replica with the fewest requests outstanding, rotating on ties."""
        live = [r for r in self.replicas if r.healthy and r.index not in exclude]
        if not live:
            raise NoReplica()
        least = min(r.outstanding for r in live)
        tied = [r for r in live if r.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=0)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        # no total timeout: a speech stream may run for minutes; connecting is bounded
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                              auto_decompress=False)
        self._checker = asyncio.create_task(self._check_health())

    async def _stop(self, _app: web.Application) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self._session is not None:
            await self._session.close()

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _check(self, replica: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{replica.url}/health",
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok != replica.healthy:
            log.info("replica up" if ok else "replica down", replica=replica.index, url=replica.url)
        replica.healthy = ok

    # ------------------------------------------------------------ routes

    async def _health(self, _request: web.Request) -> web.Response:
        replicas = [{"index": r.index, "url": r.url, "healthy": r.healthy, "outstanding": r.outstanding,
                     "served": r.served} for r in self.replicas]
        up = any(r.healthy for r in self.replicas)
        return web.json_response({"status": "ok" if up else "unavailable", "replicas": replicas},
                                 status=200 if up else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        texts = await asyncio.gather(*(self._replica_metrics(r) for r in self.replicas))
        return web.Response(text="".join(texts), content_type="text/plain", charset="utf-8")

    async def _replica_metrics(self, replica: Replica) -> str:
        assert self._session is not None
        try:
            async with self._session.get(f"{replica.url}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return f'mstar_replica_up{{replica="{replica.index}"}} 0\n'
        return f'mstar_replica_up{{replica="{replica.index}"}} 1\n' + labelled(text, replica.index)

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("upgrade", "").lower() == "websocket":
            return await self._pass_socket(request)
        tried: set[int] = set()
        body = request.content if request.body_exists else None
        while True:
            try:
                replica = self.pick(tried)
            except NoReplica:
                return _unavailable()
            tried.add(replica.index)
            try:
                return await self._pass_to(replica, request, body)
            except _NotStarted as e:
                if body is not None and e.sent_body:
                    # the body already went (in part) into the lost connection: it cannot be sent again
                    return _unavailable()
                replica.healthy = False
                log.warning("replica unreachable; trying another", replica=replica.index, error=str(e.error))

    async def _pass_to(self, replica: Replica, request: web.Request,
                       body: aiohttp.StreamReader | None) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        sent = _Sent(body)
        replica.outstanding += 1
        try:
            try:
                upstream = await self._session.request(request.method, replica.url + request.rel_url.path_qs,
                                                       headers=headers, data=sent.body(), allow_redirects=False)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                raise _NotStarted(e, sent.started) from None
            replica.served += 1
            async with upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        response.headers.add(k, v)
                if upstream.headers.get("transfer-encoding", "").lower() == "chunked" or \
                        "content-length" not in upstream.headers:
                    response.enable_chunked_encoding()
                else:
                    response.content_length = int(upstream.headers["content-length"])
                await response.prepare(request)
                try:
                    async for data in upstream.content.iter_any():
                        await response.write(data)
                except aiohttp.ClientError as e:  # the replica failed mid-answer: the client's stream ends short
                    log.warning("replica failed mid-answer; cutting it short", replica=replica.index, error=str(e))
                    response.force_close()
                    return response
                await response.write_eof()
                return response
        finally:
            replica.outstanding -= 1

    async def _pass_socket(self, request: web.Request) -> web.StreamResponse:
        """A websocket: one replica for the whole session, frames both ways."""
        assert self._session is not None
        try:
            replica = self.pick()
        except NoReplica:
            return _unavailable()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_HEADERS and not k.lower().startswith("sec-websocket")}
        replica.outstanding += 1
        try:
            try:
                upstream = await self._session.ws_connect(replica.url + request.rel_url.path_qs, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("replica refused a websocket", replica=replica.index, error=str(e))
                return _unavailable()
            replica.served += 1
            client = web.WebSocketResponse()
            await client.prepare(request)
            async with upstream:
                await _pump_both(client, upstream)
            await client.close()
            return client
        finally:
            replica.outstanding -= 1


def labelled(text: str, index: int) -> str:
    """Prometheus text with `replica="index"` on every sample (comments and blank lines kept)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name, sep, rest = line.partition(" ")
        if "{" in name:
            head, _, labels = name.partition("{")
            name = f'{head}{{replica="{index}",{labels}'
        else:
            name = f'{name}{{replica="{index}"}}'
        out.append(name + sep + rest)
    return "\n".join(out) + "\n"


async def _pump_both(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Frames client -> replica and replica -> client until either side closes."""
    async def forward(src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                      dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> None:
        async for msg in src:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                break
        await dst.close()

    tasks = [asyncio.create_task(forward(client, upstream)), asyncio.create_task(forward(upstream, client))]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _NotStarted(Exception):
    """The replica could not be reached: the request never started there."""

    def __init__(self, error: BaseException, sent_body: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.sent_body = sent_body


class _Sent:
    """The request body as it is passed on, noting whether any of it went."""

    def __init__(self, body: aiohttp.StreamReader | None) -> None:
        self._body = body
        self.started = False

    def body(self) -> AsyncIterator[bytes] | None:
        """What aiohttp's `data=` streams on (None: no body)."""
        if self._body is None:
            return None
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        assert self._body is not None
        async for data in self._body.iter_any():
            self.started = True
            yield data


def _unavailable() -> web.Response:
    return web.json_response({"error": {"message": "no replica is available", "type": "server_error",
                                        "param": None, "code": "unavailable"}}, status=503,
                             headers={"Retry-After": "1"})


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m mstar.cluster.front --replicas URL,URL [--host H] [--port P]`: the front over
    replicas already serving (each `python -m mstar.http` on its own host or port)."""
    import argparse

    p = argparse.ArgumentParser(description="one address over several mstar replicas")
    p.add_argument("--replicas", required=True, help="base URLs, comma-separated: http://10.0.0.2:8000,...")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args(argv)
    urls = [u.strip() for u in a.replicas.split(",") if u.strip()]
    web.run_app(Front(urls).app(), host=a.host, port=a.port, access_log=None)


if __name__ == "__main__":
    main()
