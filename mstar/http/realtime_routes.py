"""`GET /v1/realtime`: the OpenAI Realtime API over a websocket.

The model comes from the `model` query parameter (default: the served one);
an unknown model is refused before the upgrade (404). Then one reader (this
handler) feeds client events to the `RealtimeSession` in order, and one
writer task sends what the session queues, in order. A bad event gets an
`error` event and the socket stays open; a message over the size limit gets
one too, then the close aiohttp makes. Closing the socket cancels the
session's response and frees everything it held.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import structlog
from aiohttp import WSMsgType, web

from mstar.http.keys import ENGINE
from mstar.http.realtime_protocol import ProtocolError, error_event, parse_event
from mstar.http.realtime_session import RealtimeSession
from mstar.http.submission import resolve_model

log = structlog.get_logger("mstar.realtime")

MAX_MESSAGE_BYTES = 16 * 2**20  # a client event (an audio append, say); larger ones close the socket (1009)
HEARTBEAT_S = 30.0


async def realtime(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    target = resolve_model(engine, request.query.get("model"))
    card = next(c for c in engine.model_cards() if c.name == target.name)
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    outbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def send(obj: dict[str, Any]) -> None:
        # serialised now: an event shows the state of the moment it was made
        outbox.put_nowait(orjson.dumps(obj))

    writer = asyncio.get_running_loop().create_task(_write(ws, outbox), name="realtime-writer")
    session = RealtimeSession(engine, target, card, send)
    log.info("realtime session opened", session_id=session.config.session_id, model=target.name)
    session.start()
    try:
        async for msg in ws:
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await _handle(session, msg.data, send)
            elif msg.type == WSMsgType.ERROR:
                error = ProtocolError(f"the websocket failed: {ws.exception()}", "websocket_error")
                send(error_event(error))
                break
    finally:
        await session.close()
        outbox.put_nowait(None)
        try:
            await asyncio.wait_for(writer, 5.0)
        except (TimeoutError, ConnectionError):
            writer.cancel()
        await ws.close()
        log.info("realtime session closed", session_id=session.config.session_id)
    return ws


async def _handle(session: RealtimeSession, data: str | bytes, send) -> None:
    client_event_id = None
    try:
        obj = parse_event(data)
        client_event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
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
