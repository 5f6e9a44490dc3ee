"""The front address of several mstar replicas: every HTTP request in, passed
to one replica and its answer streamed back as it comes; a websocket
(`/v1/realtime`) pinned to one replica for its whole session.

Routing takes the healthy replica with the fewest requests outstanding (the
rule of in-process replicas), the one after the last pick on a tie. A replica
that refuses a connection, or whose `/health` stops answering, is marked down
and left out until its health check passes again; a request that could not
reach one is tried on the next, since it never started there. A replica that
fails after it began answering ends that answer: an event stream with an
`{"error": ...}` event, a realtime session with an `error` event and close
code 1011, any other body cut before its end; never a silent retry that
could speak twice. `/health` lists the replicas; `/metrics` merges the replicas'
metric families, every sample labelled `replica="<index>"`.

Bodies pass through unbuffered both ways (NDJSON input streamed to the
speech route included), so the front adds one hop per chunk, not a wait for
whole responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence, Set
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from mstar.cluster import serving
from mstar.cluster.prometheus_text import labelled, merged
from mstar.cluster.relay import DONE, FRONT_STOPPED, event, pump_both, relay

log = structlog.get_logger("mstar.cluster.front")

# connections waiting to be accepted: a burst of streaming clients is more than aiohttp's default 128, past
# which a handshake is dropped and retried a second later (a replica's `mstar.http.listener` keeps as many)
BACKLOG = 2048
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0
WS_MAX_MESSAGE = 16 << 20   # the replicas' realtime socket takes messages this large
# a stop signal, as a replica takes one: running answers get DRAIN_S to end, then event streams end with an error
# event and what is left is cut; the process is gone within GRACE_S (a realtime socket closes 1001 after the drain)
DRAIN_S = 7.0
GRACE_S = 10.0
# aiohttp waits this long for the handlers left after the drain, and as long again once it cancelled them;
# `_drain` spends up to 1 s ending event streams
SHUTDOWN_TIMEOUT_S = (GRACE_S - DRAIN_S - 1.0) / 2
# headers that describe one hop's connection, not the message (RFC 9110 7.6.1), and those aiohttp sets itself;
# Host passes on: a replica's same-origin check compares it with the page's Origin
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length"})


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
        self._session: aiohttp.ClientSession | None = None   # requests passed on: no cap on connections
        self._probe: aiohttp.ClientSession | None = None     # health checks and metrics, never queued behind them
        self._sockets: set[web.WebSocketResponse] = set()
        self._relays: set[asyncio.Task] = set()  # handlers relaying an event stream: a stop ends theirs

    # ------------------------------------------------------------ routing

    def pick(self, exclude: Set[int] = frozenset()) -> Replica:
        """The healthy replica with the fewest requests outstanding, rotating on ties."""
        live = [r for r in self.replicas if r.healthy and r.index not in exclude]
        if not live:
            raise NoReplica()
        least = min(r.outstanding for r in live)
        tied = [r for r in live if r.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def relocate(self, index: int, url: str) -> None:
        """Replica `index` serves at `url` now (restarted elsewhere, and answering there)."""
        replica = self.replicas[index]
        url = url.rstrip("/")
        if url != replica.url:   # its actor answered with the URL only once the server's /health did
            log.info("replica moved", replica=index, url=url, was=replica.url)
            replica.url, replica.healthy = url, True

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The aiohttp app: `/health`, `/metrics`, and every other path passed to a replica. Serve it
        with `handler_cancellation=True`, so a client that hangs up ends its replica request at once."""
        app = web.Application(client_max_size=0)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        app.cleanup_ctx.append(self._lifetime)
        app.on_shutdown.append(self._drain)
        return app

    async def _lifetime(self, _app: web.Application) -> AsyncIterator[None]:
        # no total timeout: a speech stream may run for minutes; connecting is bounded
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                              auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        self._probe = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S))
        checkers = [asyncio.create_task(self._check_health(r)) for r in self.replicas]
        try:
            yield
        finally:
            for t in checkers:
                t.cancel()
            await asyncio.gather(*checkers, return_exceptions=True)
            await self._session.close()
            await self._probe.close()

    async def _drain(self, _app: web.Application, drain_s: float | None = None) -> None:
        """Shutdown (the listener is closed): answers under way get `drain_s`
        (default `DRAIN_S`) to end; then each event stream left ends with an
        error event (its handler cancelled here, while its connection is still
        open: aiohttp's own cancel closes it at once) and the realtime sockets
        close going away; aiohttp cuts what is left."""
        deadline = asyncio.get_running_loop().time() + (DRAIN_S if drain_s is None else drain_s)
        while any(r.outstanding for r in self.replicas) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        relays = list(self._relays)
        for task in relays:  # each ends its stream with an error event while its connection is still open
            task.cancel()
        if relays:
            await asyncio.wait(relays, timeout=1.0)
        for ws in list(self._sockets):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"server shutdown")

    async def _check_health(self, replica: Replica) -> None:
        """One replica's checks, on their own: a slow one holds no other's."""
        while True:
            try:
                await self._check(replica)
            except Exception:   # a check must never end the loop
                log.exception("health check failed", replica=replica.index)
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _check(self, replica: Replica) -> None:
        assert self._probe is not None
        try:
            async with self._probe.get(f"{replica.url}/health") as r:
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

    async def _metrics(self, request: web.Request) -> web.Response:
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}   # replicas with keys
        texts = await asyncio.gather(*(self._replica_metrics(r, auth) for r in self.replicas))
        up = "".join(f'mstar_replica_up{{replica="{r.index}"}} {int(t is not None)}\n'
                     for r, t in zip(self.replicas, texts))
        body = ("# HELP mstar_replica_up whether the replica's /metrics answered\n# TYPE mstar_replica_up gauge\n"
                + up + merged([labelled(t, r.index) for r, t in zip(self.replicas, texts) if t is not None]))
        return web.Response(text=body, content_type="text/plain", charset="utf-8")

    async def _replica_metrics(self, replica: Replica, headers: dict[str, str]) -> str | None:
        assert self._probe is not None
        try:
            async with self._probe.get(f"{replica.url}/metrics", headers=headers) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

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
                if isinstance(e.error, aiohttp.ClientConnectorError):   # refused: down until its health answers
                    replica.healthy = False
                log.warning("replica unreachable; trying another", replica=replica.index, error=str(e.error))

    async def _pass_to(self, replica: Replica, request: web.Request,
                       body: aiohttp.StreamReader | None) -> web.StreamResponse:
        assert self._session is not None
        headers = _forwarded(request)
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
                events = upstream.content_type == "text/event-stream"
                task = asyncio.current_task()
                if events and task is not None:
                    self._relays.add(task)
                try:
                    return await relay(replica.index, upstream, request, response, events)
                except asyncio.CancelledError:  # the drain is over (`_drain`), or the client left
                    if not events or task is None:
                        raise   # chunked audio has no way to say more: it is cut
                    task.uncancel()  # handled: the connection's task goes on to finish this answer
                    with contextlib.suppress(ConnectionError, RuntimeError):  # a client that left hears nothing
                        await response.write(event(FRONT_STOPPED) + DONE)
                        await response.write_eof()
                    return response
                finally:
                    self._relays.discard(task)
        finally:
            replica.outstanding -= 1

    async def _pass_socket(self, request: web.Request) -> web.StreamResponse:
        """A websocket: one replica for the whole session, frames both ways."""
        assert self._session is not None
        try:
            replica = self.pick()
        except NoReplica:
            return _unavailable()
        headers = {k: v for k, v in _forwarded(request).items() if not k.lower().startswith("sec-websocket")}
        offered = tuple(p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip())
        replica.outstanding += 1
        try:
            try:
                upstream = await self._session.ws_connect(replica.url + request.rel_url.path_qs, headers=headers,
                                                          protocols=offered, max_msg_size=WS_MAX_MESSAGE)
            except aiohttp.WSServerHandshakeError as e:   # the replica's own answer (401, 403, 404): passed on
                # typed by status as the replicas type theirs (`http/responses.error_type`; no mstar import here)
                kind = "requests" if e.status == 429 else "invalid_request_error" if e.status < 500 else "server_error"
                return web.json_response({"error": {"message": e.message, "type": kind, "param": None, "code": None}},
                                         status=e.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("replica refused a websocket", replica=replica.index, error=str(e))
                return _unavailable()
            replica.served += 1
            async with upstream:
                client = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (),
                                               max_msg_size=WS_MAX_MESSAGE)
                await client.prepare(request)
                self._sockets.add(client)
                try:
                    await pump_both(client, upstream)
                finally:
                    self._sockets.discard(client)
                    await client.close()
            return client
        finally:
            replica.outstanding -= 1


def _forwarded(request: web.Request) -> dict[str, str]:
    """The request's headers for the replica: end-to-end ones, and who the client is."""
    named = {h.strip().lower() for h in request.headers.get("Connection", "").split(",")}   # hop-by-hop too
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() not in named}
    peer = request.remote
    if peer:
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    return headers


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

    p = argparse.ArgumentParser(prog="python -m mstar.cluster.front",
                                description="One address over several mstar replicas. It checks no keys itself: "
                                            "a request's Authorization header goes on to the replica, whose "
                                            "--api-key decides.")
    p.add_argument("--replicas", required=True, help="base URLs, comma-separated: http://10.0.0.2:8000,...")
    p.add_argument("--host", default="127.0.0.1", help="the front's address, as the server's "
                                                        "--host (0.0.0.0: every interface; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the front's port (default 8080)")
    a = p.parse_args(argv)
    urls = [u.strip() for u in a.replicas.split(",") if u.strip()]
    print(f"mstar front over {', '.join(urls)} on http://{a.host}:{a.port}", flush=True)
    serving.run(Front(urls).app(), host=a.host, port=a.port, backlog=BACKLOG, shutdown_timeout=SHUTDOWN_TIMEOUT_S)


if __name__ == "__main__":
    main()
