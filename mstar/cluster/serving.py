"""The front's process: its aiohttp app served on one address until a stop
signal, then stopped within the front's grace (`front.DRAIN_S`, `GRACE_S`):
whatever of the stop is not done by `stop_within_s` after the signal is
cancelled, so a handler or client that will not let go cannot hold the
process past it.

aiohttp's own `run_app` stops every connection from reading at the start of a
shutdown, websockets included, so a realtime client's messages during the
drain (a `response.cancel`) would be dropped, and so would the rest of a body
still coming in; here a websocket reads on until the front's drain closes it,
and a request's body is read to its end while its answer drains.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from mstar.cluster.upstream import error_body, error_response

HEADER_TIMEOUT_S = 10.0  # as a replica's --header-timeout
# the app's hook for each 408 a connection answers a stalled head with itself, before any handler sees it
HEAD_OVERDUE = web.AppKey("head_overdue", Callable[[], None])


class _Connection(web.RequestHandler):
    """A front's connection: reads a body to its end through a stop, answers a head it cannot parse as a
    replica would, and closes one whose header block has not arrived `header_timeout` seconds after the
    connection opened or the head's first byte came (a 408 when some of it did): the front reaches a replica
    only with a whole head, so a replica's own deadline never sees a client that stalls in it. A replica's
    connections do the same (`mstar/http/deadlines.py`); cluster/ imports no other mstar module, so the few
    lines are its own."""

    def __init__(self, manager: web.Server, *, header_timeout: float, on_head_408: Callable[[], None] | None,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout = header_timeout
        self.on_head_408 = on_head_408
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # some of the awaited head arrived: it gets a 408, not a silent close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count  # aiohttp's count of the heads it parsed
        if self._close and not self._force_close:
            # the stop began (`_Server.pre_shutdown`), and aiohttp drops whatever arrives from then on: a request
            # whose body is still coming in would never see its end, although the drain waits for its answer
            self._close = False
            try:
                super().data_received(data)
            finally:
                self._close = True
        else:
            super().data_received(data)
        if self._request_count != parsed:
            self._disarm()
        elif data.strip(b"\r\n") and (self._head_timer is not None
                                       or (self._waiter is not None and not self._waiter.done())):
            # bytes of a head, the connection waiting for its request (aiohttp's `_waiter`); a bare CRLF between
            # requests is none (RFC 9112: ignored, as the parser does)
            self._arm()
            self._head_bytes = True

    def _arm(self) -> None:
        if self._head_timer is None and self.header_timeout > 0:
            self._head_timer = self._loop.call_later(self.header_timeout, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = False

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport is None:
            return
        if self._head_bytes:
            body = json.dumps(error_body(408, "request_timeout", f"the request head did not arrive within "
                                                                 f"{self.header_timeout:g} s (--header-timeout)")
                              ).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            if self.on_head_408 is not None:
                self.on_head_408()
        self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # a head the parser refused (a header over 8 KiB, say) never reaches a replica: answered in the
        # replicas' JSON error shape, as they answer it, not aiohttp's text/plain
        response = error_response(status, "bad_request", message or "malformed request")
        response.force_close()
        return response


class _Server(web.Server):
    def __init__(self, *args: Any, header_timeout: float, on_head_408: Callable[[], None] | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.on_head_408 = on_head_408

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, loop=self._loop, header_timeout=self.header_timeout, on_head_408=self.on_head_408,
                           **self._kwargs)

    def pre_shutdown(self) -> None:
        """Shutdown's first move: connections stop taking requests, but a
        websocket's session reads on (the drain closes it)."""
        for conn in self.connections:
            if not conn._upgraded:  # aiohttp's own flag: the connection became a websocket
                conn.close()


class FrontRunner(web.AppRunner):
    """`web.AppRunner` whose shutdown leaves websockets to the app's drain, and
    whose connections have a header deadline of `header_timeout` s (0: none)."""

    def __init__(self, app: web.Application, *, header_timeout: float = HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, builds aiohttp's own factory
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, header_timeout=self.header_timeout,
                       on_head_408=self.app.get(HEAD_OVERDUE), **plain._kwargs)


def run(app: web.Application | Awaitable[web.Application], *, host: str, port: int, backlog: int,
        shutdown_timeout: float, stop_within_s: float | None = None, ready: Callable[[], None] | None = None,
        header_timeout: float = HEADER_TIMEOUT_S) -> None:
    """Serve `app` (or the app an awaitable gives, made on the serving loop)
    until SIGINT or SIGTERM; then the app's shutdown (its drain) runs, and
    aiohttp gives the handlers left `shutdown_timeout` s, twice (before and
    after cancelling them); all of it cut at `stop_within_s` after the signal
    (None: no bound). `ready()` runs once it listens; an address it cannot
    listen on raises OSError. `header_timeout`: see `FrontRunner`."""
    asyncio.run(_serve(app, host, port, backlog, shutdown_timeout, stop_within_s, ready, header_timeout))


async def _serve(app: web.Application | Awaitable[web.Application], host: str, port: int, backlog: int,
                 shutdown_timeout: float, stop_within_s: float | None, ready: Callable[[], None] | None,
                 header_timeout: float) -> None:
    if not isinstance(app, web.Application):
        app = await app
    runner = FrontRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                         header_timeout=header_timeout)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port, backlog=backlog).start()
        if ready is not None:
            ready()
        await stop.wait()
    finally:
        try:
            await asyncio.wait_for(runner.cleanup(), stop_within_s)
        except asyncio.TimeoutError:   # what is left (handlers, the app's cleanup) is cancelled as the loop ends
            print(f"stop took over {stop_within_s} s; cutting what is left", file=sys.stderr, flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
