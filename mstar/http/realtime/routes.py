"""`GET /v1/realtime`: the OpenAI Realtime API over a websocket.

The model comes from the `model` query parameter (default: the served one);
an unknown model is refused before the upgrade (404). Then one reader (this
handler) feeds client events to the `RealtimeSession` in order, and one
writer task sends what the session queues, in order. A bad event gets an
`error` event and the socket stays open. A message over the size limit
closes the socket with 1009 and a reason; the client is still sending it
then, so the connection stays half-open until it has stopped (or a grace
period passed): closed at once, the client would get a reset and lose the
close frame. Closing the socket cancels the session's response and frees
everything it held.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from aiohttp import WSCloseCode, WSMsgType, web

from mstar.http.keys import CLOSING, ENGINE, MEDIA_LIMITS, SOCKETS, TARGETS
from mstar.http.realtime.protocol import ProtocolError, check_event, error_event, parse_event
from mstar.http.realtime.response import SETTLE_S
from mstar.http.realtime.session import RealtimeSession

log = structlog.get_logger("mstar.realtime")

CLOSE_S = 10.0  # seconds a closing session's response may take to end and free what it holds
MAX_MESSAGE_BYTES = 16 * 2**20  # a client event (an audio append, say); larger ones close the socket (1009)
HEARTBEAT_S = 30.0
TOO_BIG_GRACE_S = 5.0  # how long a client sending a message over the limit may take to stop
# at shutdown, how long an aborted response may take to send its last events: the workers' count of its tokens
# (up to SETTLE_S), then the events themselves
GOING_AWAY_S = SETTLE_S + 1.0


class _Socket(web.WebSocketResponse):
    """aiohttp's websocket, but a message over the size limit closes with a
    reason, and the transport only half-closes (the handler closes it once
    the client stopped sending)."""

    too_big = False

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        if code == WSCloseCode.MESSAGE_TOO_BIG and not self.closed:
            self.too_big = True
            message = message or f"a client event may be at most {MAX_MESSAGE_BYTES} bytes".encode()
        return await super().close(code=code, message=message, drain=drain)

    def _close_transport(self) -> None:
        transport = self._req.transport if self._req is not None else None
        if self.too_big and transport is not None and transport.can_write_eof():
            transport.write_eof()  # the close frame goes out; what the client still sends is read and dropped
            return
        super()._close_transport()


async def realtime(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Upgrade", "").strip().lower() != "websocket":
        # a plain request: the route speaks websocket only (RFC 9110's 426); a websocket handshake that is
        # malformed gets aiohttp's own 400 from `prepare`, which says what is wrong with it
        raise web.HTTPUpgradeRequired(headers={"Upgrade": "websocket", "Connection": "Upgrade"})
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(request.query.get("model"))
    card = next(c for c in engine.model_cards() if c.answers_to(target.name))
    # "realtime": what a browser offers beside its key's subprotocol (access.py), and must hear back
    ws = _Socket(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=HEARTBEAT_S, protocols=("realtime",))
    await ws.prepare(request)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def send(obj: dict[str, Any]) -> None:
        # serialised now: an event shows the state of the moment it was made
        outbox.put_nowait(orjson.dumps(obj))

    session = RealtimeSession(engine, target, card, send, request.app.get(MEDIA_LIMITS))
    writer = asyncio.get_running_loop().create_task(_write(ws, outbox),
                                                    name=f"realtime-writer-{session.config.session_id}")
    connection = _Connection(ws, session, outbox)
    request.app[SOCKETS].add(connection)
    log.info("realtime session opened", session_id=session.config.session_id, model=target.name)
    session.start()
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await _handle(session, msg.data, send)
            elif msg.type == WSMsgType.ERROR:
                log.info("realtime socket failed", session_id=session.config.session_id, error=str(ws.exception()))
                break
    finally:
        request.app[SOCKETS].discard(connection)
        # a client that hangs up cancels this handler (aiohttp's handler_cancellation), also while it closes
        # the session: the close runs in a task of its own, so it finishes (and says so) whatever happens here
        closing = asyncio.get_running_loop().create_task(_close(request, session, outbox, writer, ws),
                                                         name="realtime-close")
        request.app[CLOSING].add(closing)
        closing.add_done_callback(request.app[CLOSING].discard)
        await asyncio.shield(closing)
    return ws


async def _close(request: web.Request, session: RealtimeSession, outbox: asyncio.Queue[bytes | None],
                 writer: asyncio.Task[None], ws: _Socket) -> None:
    """End the session's response and free it (at most `CLOSE_S`), let the
    writer send what is queued (at most 5 s), close the socket. Each step
    runs whatever the one before it did: a fault is logged, not left to stop
    the rest (nothing awaits this task once its handler was cancelled)."""
    try:
        await asyncio.wait_for(session.close(), CLOSE_S)
    except Exception:
        log.exception("realtime session's response did not end cleanly", session_id=session.config.session_id)
    finally:
        outbox.put_nowait(None)
        try:
            await asyncio.wait_for(writer, 5.0)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.cancel()
            await ws.close()
            if ws.too_big:
                await _client_stopped(request)
            log.info("realtime session closed", session_id=session.config.session_id)


@dataclass(eq=False)
class _Connection:
    """An open socket and what still has to reach its client before it closes."""

    ws: _Socket
    session: RealtimeSession
    outbox: asyncio.Queue[bytes | None]

    async def going_away(self) -> None:
        """Let the session's response end (the engine aborted it) and its
        events go out, then close with 1001 and a reason."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GOING_AWAY_S
        if self.session.response is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.session.response.wait(), GOING_AWAY_S)
        while not self.outbox.empty() and not self.ws.closed and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"the server is shutting down")


async def close_sockets(app: web.Application) -> None:
    """At shutdown, once running requests were drained: each open socket gets
    its response's last events, then a close with 1001 (going away)."""
    await asyncio.gather(*(c.going_away() for c in list(app[SOCKETS])), return_exceptions=True)
    if app[CLOSING]:  # sessions already closing when the shutdown came: the engine outlives their closes
        await asyncio.wait(list(app[CLOSING]), timeout=CLOSE_S + 5.0)


async def _client_stopped(request: web.Request) -> None:
    """Wait until the client closed its end, at most `TOO_BIG_GRACE_S`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TOO_BIG_GRACE_S
    while request.transport is not None and not request.transport.is_closing() and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def _handle(session: RealtimeSession, data: str | bytes, send) -> None:
    client_event_id = None
    try:
        obj = parse_event(data)
        # read first: the refusal of an event of an unknown type still names the event the client sent
        client_event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
        check_event(obj)
        await session.handle(obj)
    except ProtocolError as e:
        send(error_event(e, client_event_id))
    except Exception:
        log.exception("realtime event failed")
        send(error_event(ProtocolError("internal server error", "internal_error", kind="server_error"),
                         client_event_id))


async def _write(ws: web.WebSocketResponse, outbox: asyncio.Queue[bytes | None]) -> None:
    while True:
        data = await outbox.get()
        if data is None or ws.closed:
            return
        try:
            await ws.send_str(data.decode())
        except ConnectionError:
            return
