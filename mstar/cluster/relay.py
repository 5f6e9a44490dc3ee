"""One answer's bytes between a client and the replica serving it: a body
relayed as it comes (an event stream by whole events), the end a client sees
when the replica fails mid-answer or the front stops, and a websocket's
frames pumped both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import aiohttp
import structlog
from aiohttp import web

log = structlog.get_logger("mstar.cluster.front")

REPLICA_LOST = {"error": {"message": "the replica serving this request failed; send it again", "type": "server_error",
                          "param": None, "code": "replica_failed"}}
FRONT_STOPPED = {"error": {"message": "the front is shutting down; send the request again", "type": "server_error",
                           "param": None, "code": "aborted"}}
DONE = b"data: [DONE]\n\n"  # after an error event too, as a replica's own streams end


async def relay(replica: int, upstream: aiohttp.ClientResponse, request: web.Request,
                response: web.StreamResponse, events: bool) -> web.StreamResponse:
    """Replica `replica`'s answer on to the client, as it comes (an event
    stream by whole events, so a failure never leaves half of one)."""
    chunks = upstream.content.iter_any()
    held = b""   # of an event stream: an event not yet whole
    while True:
        try:
            data = await chunks.__anext__()
        except StopAsyncIteration:
            if held:   # the replica's own last bytes, as it ended them
                with contextlib.suppress(ConnectionError):
                    await response.write(held)
            break
        except aiohttp.ClientError as e:
            log.warning("replica failed mid-answer", replica=replica, error=str(e))
            return await failed_mid_answer(request, response, events)
        if events:
            data, held = whole_events(held + data)
            if not data:
                continue
        try:
            await response.write(data)
        except ConnectionError:   # the client left: leaving `upstream` tells the replica
            return response
    await response.write_eof()
    return response


async def failed_mid_answer(request: web.Request, response: web.StreamResponse, events: bool) -> web.StreamResponse:
    """The replica failed after its answer began. An event stream ends with an
    `{"error": ...}` event (what OpenAI's clients raise), as the replica's own
    failures do; any other body is cut, so the client sees it incomplete
    (chunked audio has no way to say more), never a complete-looking answer.
    `events`: the answer is an event stream, its whole events sent so far."""
    if events:
        try:
            await response.write(event(REPLICA_LOST) + DONE)
            await response.write_eof()
            return response
        except ConnectionError:
            return response
    response.force_close()
    if request.transport is not None:
        request.transport.abort()
    return response


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """Server-sent events' bytes split after their last whole event: (to send, to hold)."""
    end = data.rfind(b"\n\n")
    return (data[:end + 2], data[end + 2:]) if end >= 0 else (b"", data)


async def pump_both(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
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
        if src is upstream and src.close_code in (None, aiohttp.WSCloseCode.ABNORMAL_CLOSURE):
            # the replica went away without closing: the session is over, and the client is told why
            event = {"type": "error", "event_id": f"event_{uuid.uuid4().hex[:20]}",
                     "error": {**REPLICA_LOST["error"], "event_id": None}}
            with contextlib.suppress(ConnectionError):
                await dst.send_str(json.dumps(event))
            await dst.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR, message=b"replica failed")
            return
        # the side that closed says why: its code and reason go on to the other
        await dst.close(code=src.close_code or aiohttp.WSCloseCode.OK)

    tasks = [asyncio.create_task(forward(client, upstream)), asyncio.create_task(forward(upstream, client))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:   # a handler cancelled (the front shutting down) leaves no pump behind
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
