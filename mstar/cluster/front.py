"""The front address of several mstar replicas: every HTTP request in, passed
to one replica and its answer streamed back as it comes; a websocket
(`/v1/realtime`) pinned to one replica for its whole session.

Routing takes the healthy replica with the fewest requests outstanding (the
rule of in-process replicas), the one after the last pick on a tie. A replica
that fails a request (refuses the connection, drops it, or sends nothing for
`replica_timeout` s), or whose `/health` stops answering, is marked down and
left out until its health check passes again. A request (or websocket
handshake) that could not connect to one is tried on the next, since it never
reached it. One the replica took and then dropped gets 502 `replica_failed`,
one it went silent on 504 `replica_timeout`: never a silent retry that could
speak twice (a bodiless GET, HEAD or OPTIONS excepted: it is tried on the
next). A replica that answers 429 (its waiting line full) or 503 with the
code `unavailable` (stopping, or its engine down) did not begin on the
request: one whose body the front holds (`held_body.py`) goes to the next,
and the client hears the last refusal once every replica refused. A
replica that fails after it began answering ends that answer: an event
stream with an `{"error": ...}` event, a realtime session with an `error`
event and close code 1011, any other body cut before its end.
A replica's refusal of a websocket (401, 404...) reaches the client as the
replica sent it; one that says it did not begin goes to the next, as above.
A safe request every replica took and none answered is a 504 too.
`/health` lists the replicas, with a replica's own fields (the model, the
requests running on all) as their health checks last found them; a
client's head that stalls is cut at the front's `--header-timeout` (408),
since it never reaches a replica's own. `/metrics` merges the replicas'
metric families, every sample labelled `replica="<index>"`, each replica
given `METRICS_TIMEOUT_S` to answer.

Answers pass through unbuffered, and so do request bodies (NDJSON input
streamed to the speech route always) but the small ones the front holds
(`held_body.py`), so it adds one hop per chunk, not a wait for whole
responses.
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
from yarl import URL

from mstar.cluster import serving
from mstar.cluster.front_metrics import FrontCounters
from mstar.cluster.prometheus_text import labelled, merged
from mstar.cluster.relay import DONE, FRONT_STOPPED, ClientSocket, client_stopped, event, pump_both, relay
from mstar.cluster.held_body import BODY_TIMEOUT_S, body_overdue, read_held, replayable
from mstar.cluster.upstream import (HOP_HEADERS, NOT_BEGUN, NoAnswer, Refused, could_not_connect, error_response,
                                    failed_before_answer, forwarded_headers, keep_refusal, refusal, unavailable,
                                    went_silent)

log = structlog.get_logger("mstar.cluster.front")

# connections waiting to be accepted: a burst of streaming clients is more than aiohttp's default 128, past
# which a handshake is dropped and retried a second later (a replica's `mstar.http.listener` keeps as many)
BACKLOG = 2048
HEALTH_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 2.0      # one replica's /metrics: a hung one is reported down, not waited on by the scrape
CONNECT_TIMEOUT_S = 5.0
# the longest a replica may send nothing while it holds a request: a non-streamed answer sends nothing until it is
# whole, so this is above the replicas' own --request-timeout default (600 s), past which they answer 504
# themselves; a stream that keeps producing is never cut (not a total)
REPLICA_TIMEOUT_S = 660.0
HEARTBEAT_S = 30.0           # the front pings a client's websocket as a replica does (its own pings stop at the front)
HANDSHAKE_TIMEOUT_S = 10.0   # a replica's websocket handshake answers at once; a hung one's goes to the next
WS_MAX_MESSAGE = 16 << 20   # the replicas' realtime socket takes messages this large
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})   # without a body, no effects: sent again if a replica drops one
# a stop signal, as a replica takes one: running answers get DRAIN_S to end, then event streams end with an error
# event and what is left is cut; the process is gone within GRACE_S (a realtime socket closes 1001 after the drain)
DRAIN_S = 7.0
GRACE_S = 10.0
END_S = 1.0    # after the drain: event streams' error events and realtime sockets' closes, all at once
EXIT_S = 0.5   # the app's cleanup (sessions closed, health checks ended) and the process's exit
# aiohttp waits this long for the handlers left after `_drain`, and as long again once it cancelled them
SHUTDOWN_TIMEOUT_S = (GRACE_S - DRAIN_S - END_S - EXIT_S) / 2


@dataclass(eq=False)
class Replica:
    """One replica's base URL and what the front knows of it."""

    url: str
    index: int
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    health: dict | None = None   # its last /health answer that was a JSON object


class NoReplica(Exception):
    """No healthy replica could take the request."""


class Front:
    """The replicas behind one address; `app()` serves them."""

    def __init__(self, urls: Sequence[str], replica_timeout: float = REPLICA_TIMEOUT_S,
                 body_timeout: float = BODY_TIMEOUT_S) -> None:
        """`replica_timeout`: seconds a replica may send nothing while it holds
        a request, before the client is told it stopped answering;
        `body_timeout`: seconds a body the front holds may take to arrive (408;
        0: no limit)."""
        if not urls:
            raise ValueError("a front needs at least one replica")
        if replica_timeout <= 0 or body_timeout < 0:
            raise ValueError("replica_timeout must be positive, body_timeout 0 or more")
        self.replicas = [Replica(url.rstrip("/"), i) for i, url in enumerate(urls)]
        self.replica_timeout = replica_timeout
        self.body_timeout = body_timeout
        self._turn = itertools.count()
        self._session: aiohttp.ClientSession | None = None   # requests passed on: no cap on connections
        self._probe: aiohttp.ClientSession | None = None     # health checks and metrics, never queued behind them
        self.counters = FrontCounters()
        self._sockets: set[web.WebSocketResponse] = set()
        self._relays: set[asyncio.Task] = set()  # handlers relaying an event stream: a stop ends theirs
        self._held = 0       # bytes of request bodies held whole (`held_body`)
        self._reading = 0    # held bodies still arriving

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
        app[serving.HEAD_OVERDUE] = self._head_overdue
        return app

    def _head_overdue(self) -> None:
        """The front's connection answered a stalled request head with 408 (`serving`): one of its own answers."""
        self.counters.own[408] += 1

    async def _lifetime(self, _app: web.Application) -> AsyncIterator[None]:
        # no total timeout: a speech stream may run for minutes; connecting, and each read, are bounded
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT_S, self.replica_timeout),
                                        sock_read=self.replica_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, raise_for_status=keep_refusal,
                                              connector=aiohttp.TCPConnector(limit=0))
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
        (default `DRAIN_S`) to end; then, within `END_S` all together, each
        event stream left ends with an error event (its handler cancelled
        here, while its connection is still open: aiohttp's own cancel closes
        it at once) and the realtime sockets close going away (a client that
        never answers the close is not waited on past it); aiohttp cuts what
        is left."""
        deadline = asyncio.get_running_loop().time() + (DRAIN_S if drain_s is None else drain_s)
        while (self._reading or any(r.outstanding for r in self.replicas)) \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        relays = list(self._relays)
        for task in relays:  # each ends its stream with an error event while its connection is still open
            task.cancel()
        closes = [asyncio.create_task(ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"server shutdown"))
                  for ws in list(self._sockets)]
        if relays or closes:
            await asyncio.wait([*relays, *closes], timeout=END_S)
        for task in closes:   # a close still waiting on its client: aiohttp's cancel of the handler cuts it
            task.cancel()

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
                try:   # its fields, for the front's /health; a body that is not a JSON object leaves it up
                    answer = await r.json(content_type=None) if ok else None
                except ValueError:
                    answer = None
            if isinstance(answer, dict):
                replica.health = answer
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok != replica.healthy:
            log.info("replica up" if ok else "replica down", replica=replica.index, url=replica.url)
        replica.healthy = ok

    def _down(self, replica: Replica, error: BaseException) -> None:
        """A request to `replica` failed on its connection: left out until its health check passes."""
        if replica.healthy:
            log.warning("replica down", replica=replica.index, url=replica.url, error=repr(error))
        replica.healthy = False

    # ------------------------------------------------------------ routes

    async def _health(self, _request: web.Request) -> web.Response:
        replicas = [{"index": r.index, "url": r.url, "healthy": r.healthy, "outstanding": r.outstanding,
                     "served": r.served} for r in self.replicas]
        up = [r for r in self.replicas if r.healthy]
        # a replica's own fields, as its last health check found them (HEALTH_EVERY_S), so that what reads one replica's
        # /health (the SDK's `health()`, a probe) reads the front's: the model, the requests running on all
        seen = [r.health for r in up if r.health is not None]
        models = list(dict.fromkeys(str(h.get("model", "")) for h in seen))
        fields = {"model": models[0]} if len(models) == 1 else {"models": models} if models else {}
        running = [h.get("requests_running") for h in seen]
        if running and all(isinstance(n, int) for n in running):
            fields["requests_running"] = sum(running)
        # no replica up: a 503 says when to ask again, as the front's other 503s do
        return web.json_response({"status": "ok" if up else "unavailable", **fields, "replicas": replicas},
                                 status=200 if up else 503, headers=None if up else {"Retry-After": "1"})

    async def _metrics(self, request: web.Request) -> web.Response:
        """Every replica's metrics, labelled; the client's Authorization goes
        on to each, and a replica's refusal of it (401, 403) is the answer:
        the front checks no keys, its replicas' --api-key decides."""
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}   # replicas with keys
        scrapes = await asyncio.gather(*(self._replica_metrics(r, auth) for r in self.replicas))
        for scrape in scrapes:
            if isinstance(scrape, Refused):
                return scrape.response()
        texts = [t if isinstance(t, str) else None for t in scrapes]
        up = "".join(f'mstar_replica_up{{replica="{r.index}"}} {int(t is not None)}\n'
                     for r, t in zip(self.replicas, texts))
        body = ("# HELP mstar_replica_up whether the replica's /metrics answered\n# TYPE mstar_replica_up gauge\n"
                + up + self.counters.text()
                + merged([labelled(t, r.index) for r, t in zip(self.replicas, texts) if t is not None]))
        return web.Response(text=body, content_type="text/plain", charset="utf-8")

    async def _replica_metrics(self, replica: Replica, headers: dict[str, str]) -> str | Refused | None:
        """A replica's metrics text; its refusal of the client's key; None when it did not answer in time."""
        assert self._probe is not None
        try:
            async with self._probe.get(f"{replica.url}/metrics", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)) as r:
                if r.status in (401, 403):
                    return Refused(r.status, r.reason, list(r.headers.items()), await r.read())
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("upgrade", "").lower() == "websocket":
            return await self._pass_socket(request)
        if not replayable(request, self._held):
            return await self._pass_on(request, request.content if request.body_exists else None)
        length = request.content_length or 0
        self._held += length
        try:
            self._reading += 1   # a stop's drain waits for it, as for an answer under way
            try:
                body = await read_held(request, self.body_timeout)
            finally:
                self._reading -= 1
            return self._own(body_overdue(self.body_timeout)) if body is None else await self._pass_on(request, body)
        finally:
            self._held -= length

    def _next_replica(self, tried: set[int]) -> Replica | None:
        """The replica a request tries next, not one of `tried` (None: none is
        left), counting a retry where it is not the first; it joins `tried`."""
        try:
            replica = self.pick(tried)
        except NoReplica:
            return None
        if tried:
            self.counters.retries += 1
        tried.add(replica.index)
        return replica

    async def _pass_on(self, request: web.Request, body: bytes | aiohttp.StreamReader | None) -> web.StreamResponse:
        """`body`: held whole (bytes: a replica's refusal sends it to the next), or streamed through."""
        tried: set[int] = set()
        safe = body is None and request.method in SAFE_METHODS
        taken: BaseException | None = None   # why a replica that took the request gave no answer
        refused: Refused | None = None       # the last replica's refusal of a request sent again
        while True:
            replica = self._next_replica(tried)
            if replica is None:
                if refused is not None:  # every replica left refused it: the client hears the last one
                    return refused.response()
                # a safe request some replica took and none answered failed there; it did not find none available
                return self._own(unavailable() if taken is None else failed_before_answer(taken))
            try:
                return await self._pass_to(replica, request, body)
            except Refused as e:
                if not e.resend:   # it may have begun: its answer is the client's
                    return e.response()
                log.info("replica refused; trying another", replica=replica.index, status=e.status)
                refused = e
            except NoAnswer as e:
                if not could_not_connect(e.error):
                    taken = e.error
                if not went_silent(e.error):  # a busy replica can be silent for long: its health check decides
                    self._down(replica, e.error)
                if not (could_not_connect(e.error) or safe):
                    # it reached the replica, which may have begun on it: not sent again (it could speak twice)
                    log.warning("replica failed before answering", replica=replica.index, error=repr(e.error))
                    return self._own(failed_before_answer(e.error))
                log.warning("replica unreachable; trying another", replica=replica.index, error=repr(e.error))

    def _own(self, response: web.Response) -> web.Response:
        """An answer the front gives itself, counted."""
        self.counters.own[response.status] += 1
        return response

    async def _pass_to(self, replica: Replica, request: web.Request,
                       body: bytes | aiohttp.StreamReader | None) -> web.StreamResponse:
        """`body`: read whole (bytes), or streamed through. Raises `Refused`
        for a `NOT_BEGUN` answer to a request it can send again."""
        assert self._session is not None
        headers = forwarded_headers(request)
        data = body.iter_any() if isinstance(body, aiohttp.StreamReader) else body
        replica.outstanding += 1
        try:
            try:
                # the session connects before it reads `body`: a request that could not connect can go elsewhere
                upstream = await self._session.request(request.method, _target(replica, request),
                                                       headers=headers, data=data, allow_redirects=False)
                replica.served += 1
                self.counters.answers[replica.index, upstream.status] += 1
                if upstream.status in NOT_BEGUN and not isinstance(body, aiohttp.StreamReader):
                    async with upstream:
                        raise await refusal(upstream)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                raise NoAnswer(e) from None
            async with upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        response.headers.add(k, v)
                if upstream.headers.get("transfer-encoding", "").lower() != "chunked" and \
                        "content-length" in upstream.headers:
                    response.content_length = int(upstream.headers["content-length"])
                if isinstance(body, aiohttp.StreamReader) and upstream.headers.get("connection", "").lower() == "close":
                    # the replica gave up on the body (its 408, 413): the client's connection is mid-body too, so
                    # it closes once aiohttp has drained what the client still sends (a close with unread data
                    # would reset it, and a client that reads only after sending would lose this answer); nothing
                    # after is read as a new request
                    response.force_close()
                # else no length: aiohttp chunks the body for HTTP/1.1, and for an HTTP/1.0 client (which has no
                # chunked encoding) ends it by closing the connection
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
        """A websocket: one replica for the whole session, frames both ways. A handshake with no answer, or
        refused but `not_begun`, goes to the next; another refusal, or the last, is the client's answer."""
        tried: set[int] = set()
        refused: Refused | None = None
        while True:
            replica = self._next_replica(tried)
            if replica is None:
                return refused.response() if refused is not None else self._own(unavailable())
            replica.outstanding += 1
            try:
                try:
                    upstream = await self._open_socket(replica, request)
                except Refused as e:   # the replica's own answer (401, 404, 429, 503): passed on as it is
                    if not e.resend:
                        return e.response()
                    refused = e
                    continue
                except aiohttp.WSServerHandshakeError as e:   # a 101 that is no websocket's
                    log.warning("replica answered a websocket wrongly", replica=replica.index, error=e.message)
                    return self._own(error_response(502, "replica_failed", f"the replica's websocket handshake "
                                                                           f"failed: {e.message}"))
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    self._down(replica, e)
                    log.warning("replica unreachable for a websocket; trying another", replica=replica.index,
                                error=repr(e))
                    continue
                replica.served += 1
                return await self._session_through(request, upstream)
            finally:
                replica.outstanding -= 1

    async def _open_socket(self, replica: Replica, request: web.Request) -> aiohttp.ClientWebSocketResponse:
        assert self._session is not None
        headers = {k: v for k, v in forwarded_headers(request).items() if not k.lower().startswith("sec-websocket")}
        offered = tuple(p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip())
        async with asyncio.timeout(min(HANDSHAKE_TIMEOUT_S, self.replica_timeout)):
            return await self._session.ws_connect(_target(replica, request), headers=headers,
                                                  protocols=offered, max_msg_size=WS_MAX_MESSAGE)

    async def _session_through(self, request: web.Request,
                               upstream: aiohttp.ClientWebSocketResponse) -> web.WebSocketResponse:
        async with upstream:
            client = ClientSocket(protocols=(upstream.protocol,) if upstream.protocol else (),
                                  max_msg_size=WS_MAX_MESSAGE, heartbeat=HEARTBEAT_S)
            await client.prepare(request)
            self._sockets.add(client)
            try:
                await pump_both(client, upstream)
            finally:
                self._sockets.discard(client)
                await client.close()
        if client.too_big:   # the client may still be sending it: it hears the close, not a reset
            await client_stopped(request)
        return client


def _target(replica: Replica, request: web.Request) -> URL:
    """The request's target on `replica`, as the client encoded it: decoding it would turn an escaped `?`, `#`
    or `/` of a path or query value into a delimiter, and the replica would read another path or query."""
    return URL(replica.url + request.rel_url.raw_path_qs, encoded=True)


if __name__ == "__main__":   # `python -m mstar.cluster.front`: its command line lives beside it
    from mstar.cluster.front_cli import main
    main()
