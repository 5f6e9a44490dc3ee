"""Bytes of a request arriving in, connections that stall closed: the deadline
of a request's header block and of its body.

aiohttp has no deadline of its own for either: its keep-alive timer only
closes a connection idle between requests, and a header block or a chunked
body that never ends holds the connection (and a handler) for as long as the
client likes. So:

- `ServingRunner` (an `AppRunner`) serves each connection with
  `HeadDeadlineHandler`, which closes a connection whose header block has not
  fully arrived `header_timeout` seconds after the connection opened or the
  head's first byte came (with a 408 when some of it did). The keep-alive
  timer still governs an idle connection between requests. At shutdown a
  connection's handler is cancelled within the runner's shutdown timeout
  (aiohttp alone takes up to twice it). A head the parser refuses is a JSON
  400 and one log line, as other refusals are. It reads two of
  aiohttp's protocol internals, as aiohttp's own keep-alive check does:
  `_waiter` (pending while the connection waits for a request) and
  `_request_count` (requests whose heads were parsed); the runner builds its
  connection factory from aiohttp's own (its handler arguments, `_kwargs`).
- `body_deadline` fails the body stream of a request whose body has not fully
  arrived `body_timeout` seconds after its handler began, so the handler's
  read raises `BodyTimedOut`; the answer is a 408 and the connection closes.
  A body that legitimately keeps arriving while the answer streams out (text
  streamed into speech, NDJSON) has no whole-body deadline; its deadline is
  idle time instead: no new byte for `body_timeout` seconds, checked every
  quarter of it, ends the input the same way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.typedefs import Middleware

from mstar.http.logs import Handler
from mstar.http.responses import error_body, error_response
from mstar.http.speech.routes import NDJSON

log = structlog.get_logger("mstar.http")

# bodies that keep arriving while the answer streams out: only their idle time is bounded
STREAMED_IN_PATHS = frozenset({"/v1/audio/speech"})
HEAD_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                       b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


class BodyTimedOut(TimeoutError):
    """Set on a body stream whose bytes stopped arriving in time; a
    `TimeoutError` so aiohttp's lingering read after the answer takes it as
    the end of that body rather than as a fault."""


class BodyWatch:
    """Fails `content` with `BodyTimedOut` once it is overdue: not complete
    `timeout` seconds from now, or with `idle`, no new byte for `timeout`."""

    def __init__(self, content: StreamReader, timeout: float, *, idle: bool) -> None:
        self.content = content
        self.timeout = timeout
        self.idle = idle
        self.loop = asyncio.get_running_loop()
        self.seen = content.total_bytes
        self.last_byte_at = self.loop.time()
        self._handle = self.loop.call_later(timeout / 4 if idle else timeout, self._check)

    def _check(self) -> None:
        if self.content.is_eof():
            return
        now = self.loop.time()
        if self.idle:
            if self.content.total_bytes != self.seen:
                self.seen, self.last_byte_at = self.content.total_bytes, now
            if now - self.last_byte_at < self.timeout:
                self._handle = self.loop.call_later(self.timeout / 4, self._check)
                return
        what = "no more of the request body arrived" if self.idle else "the request body did not finish arriving"
        log.info("request body overdue", error=what, timeout=self.timeout)
        self.content.set_exception(BodyTimedOut(f"{what} within {self.timeout:g} s"))

    def cancel(self) -> None:
        self._handle.cancel()


def streamed_in(request: web.Request) -> bool:
    return request.path in STREAMED_IN_PATHS and request.content_type == NDJSON


def body_deadline(timeout: float) -> Middleware:
    """The middleware holding each request's body to `timeout` seconds (0: none)."""
    @web.middleware
    async def deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if timeout <= 0 or not request.body_exists or request.content.is_eof():
            return await handler(request)
        watch = BodyWatch(request.content, timeout, idle=streamed_in(request))
        try:
            return await handler(request)
        except BodyTimedOut as e:
            response = error_response(f"{e} (--body-timeout)", status=408, code="request_timeout")
            response.force_close()
            return response
        finally:
            watch.cancel()
    return deadline


class HeadDeadlineHandler(web.RequestHandler):
    """aiohttp's connection protocol, with a deadline on each header block."""

    def __init__(self, manager: web.Server, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # some of the awaited head arrived: it gets a 408, not a silent close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        if self._close and not self._force_close:
            # shutdown began (`close`), and aiohttp drops whatever arrives from then on: a body half sent
            # would never end, and its request would be cut with no answer although the drain waits for it
            self._close = False
            try:
                super().data_received(data)
            finally:
                self._close = True
        else:
            super().data_received(data)
        if self._request_count != parsed:
            self._disarm()  # a head arrived; its body has a deadline of its own
        elif data.strip(b"\r\n") and (self._head_timer is not None or self._waiting_for_request()):
            # bytes of a head; a bare CRLF between requests is not one (RFC 9112: ignored, as the parser does)
            self._arm()
            self._head_bytes = True

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        # a head the parser refused is the client's fault: aiohttp logs each at error level with a traceback
        # and answers in text/plain, where every other refusal is a JSON error and one log line. The line
        # names the error's kind only: its message quotes the offending header, an Authorization one too.
        # Not HTTP at all (TLS to this port, a scanner) stays at debug, as aiohttp has it.
        level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
        log.log(level, "malformed request", status=status, error=type(exc).__name__, remote=request.remote)
        response = error_response(message or "malformed request", status=status, code="bad_request")
        response.force_close()
        return response

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        # aiohttp waits `timeout` for the handler, then as long again after cancelling only the request's body,
        # which a handler blocked writing to a client that stopped reading never notices; only then does it
        # cancel the handler. Half each keeps the whole within the runner's shutdown timeout.
        await super().shutdown(None if timeout is None else timeout / 2)

    def _waiting_for_request(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

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
            body = orjson.dumps(error_body(f"the request head did not arrive within {self.header_timeout:g} s "
                                           "(--header-timeout)", status=408, code="request_timeout"))
            self.transport.write(HEAD_TIMEOUT_ANSWER % (len(body), body))
        log.info("request head overdue; closing", header_timeout=self.header_timeout, partial=self._head_bytes)
        self.force_close()


class DeadlineServer(web.Server):
    """aiohttp's connection factory, making `HeadDeadlineHandler`s."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout

    def __call__(self) -> web.RequestHandler:
        return HeadDeadlineHandler(self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs)

    def pre_shutdown(self) -> None:
        """Shutdown's first move: every connection stops taking requests. One
        waiting for its next request closes now (aiohttp would keep it open,
        reading nothing, until the drain ended, so a pooled client sending on
        it waited seconds for the close); one whose request runs answers it,
        then closes. A websocket's session reads on through the drain (a
        realtime client's cancel must reach it); the drain closes those."""
        for conn in self.connections:
            # aiohttp's own flag that the connection became a websocket (`_upgrade` before 3.14)
            if getattr(conn, "_upgraded", getattr(conn, "_upgrade", False)):
                continue
            idle = isinstance(conn, HeadDeadlineHandler) and conn._waiting_for_request()
            conn.close()
            if idle:
                conn.force_close()


class ServingRunner(web.AppRunner):
    """`web.AppRunner` whose connections have a header deadline of
    `header_timeout` seconds (0: none)."""

    def __init__(self, app: web.Application, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, builds aiohttp's own factory
        return DeadlineServer(plain.request_handler, request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation,
                              header_timeout=self.header_timeout, **plain._kwargs)
