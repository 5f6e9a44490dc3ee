"""One answer's bytes between a client and the replica serving it: a body
relayed as it comes (an event stream by whole events), the end a client sees
when the replica fails mid-answer or the front stops, and a websocket's
frames pumped both ways, each side's close code and reason passed to the
other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import aiohttp
import structlog
from aiohttp import web

log = structlog.get_logger("mstar.cluster.front")

REPLICA_LOST = {"error": {"message": "the replica serving this request failed; send it again", "type": "server_error",
                          "param": None, "code": "replica_failed"}}
REPLICA_SILENT = {"error": {"message": "the replica serving this request stopped answering; send it again",
                            "type": "server_error", "param": None, "code": "replica_timeout"}}
FRONT_STOPPED = {"error": {"message": "the front is shutting down; send the request again", "type": "server_error",
                           "param": None, "code": "aborted"}}
MAX_REASON = 123          # bytes of a close frame's reason (RFC 6455 5.5: 125 bytes of payload, 2 of them the code)
TOO_BIG_GRACE_S = 5.0     # how long a client sending a message over the limit may take to stop
DONE = b"data: [DONE]\n\n"  # after an error event too, as a replica's own streams end


async def relay(replica: int, upstream: aiohttp.ClientResponse, request: web.Request,
                response: web.StreamResponse, events: bool) -> web.StreamResponse:
    """Replica `replica`'s answer on to the client, as it comes (an event
    stream by whole events, so a failure never leaves half of one). A replica
    that went silent for the session's read timeout fails it as a lost one
    does, with its own error code. One answer lost does not mark the replica
    down: its health check decides that."""
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
            log.warning("replica failed mid-answer", replica=replica, error=repr(e))
            silent = isinstance(e, aiohttp.ServerTimeoutError)
            return await failed_mid_answer(request, response, events, REPLICA_SILENT if silent else REPLICA_LOST)
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


async def failed_mid_answer(request: web.Request, response: web.StreamResponse, events: bool,
                            error: dict = REPLICA_LOST) -> web.StreamResponse:
    """The replica failed after its answer began. An event stream ends with an
    `{"error": ...}` event (what OpenAI's clients raise), as the replica's own
    failures do; any other body is cut, so the client sees it incomplete
    (chunked audio has no way to say more), never a complete-looking answer.
    `events`: the answer is an event stream, its whole events sent so far;
    `error`: what its last event says."""
    if events:
        try:
            await response.write(event(error) + DONE)
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


class ClientSocket(web.WebSocketResponse):
    """The client's side of a relayed websocket. A message over its limit
    (the replicas' own) closes it 1009 with a reason, as a replica's socket
    does, and the transport only half-closes: a client still sending the
    message reads the close frame instead of a reset (`client_stopped` then
    waits for it to hang up)."""

    too_big = False

    def __init__(self, *, max_msg_size: int, **kwargs: Any) -> None:
        super().__init__(max_msg_size=max_msg_size, **kwargs)
        self.limit = max_msg_size

    async def close(self, *, code: int = aiohttp.WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        if code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG and not self.closed:
            self.too_big = True
            if not message and self.close_code == code:   # its reader refused the message (aiohttp notes why first)
                message = f"a client event may be at most {self.limit} bytes".encode()
        return await super().close(code=code, message=message, drain=drain)

    def _close_transport(self) -> None:   # aiohttp's own step; mstar.http's realtime socket overrides it alike
        transport = self._req.transport if self._req is not None else None
        if self.too_big and transport is not None and transport.can_write_eof():
            transport.write_eof()   # the close frame goes out; what the client still sends is read and dropped
            return
        super()._close_transport()


async def client_stopped(request: web.Request, within_s: float = TOO_BIG_GRACE_S) -> None:
    """Wait until the client closed its end, at most `within_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while request.transport is not None and not request.transport.is_closing() and loop.time() < deadline:
        await asyncio.sleep(0.05)


async def pump_both(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Frames client -> replica and replica -> client until either side
    closes; the close code and reason of the side that closed go on to the
    other."""
    async def forward(src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                      dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> None:
        while True:
            msg = await src.receive()
            if msg.type == aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                break
        # a close frame carries its code and reason; anything else (an error, a lost connection) only a code
        code, reason = (msg.data, msg.extra or "") if msg.type == aiohttp.WSMsgType.CLOSE else (src.close_code, "")
        if src is upstream and code in (None, aiohttp.WSCloseCode.ABNORMAL_CLOSURE):
            # the replica went away without closing: the session is over, and the client is told why
            event = {"type": "error", "event_id": f"event_{uuid.uuid4().hex[:20]}",
                     "error": {**REPLICA_LOST["error"], "event_id": None}}
            with contextlib.suppress(ConnectionError):
                await dst.send_str(json.dumps(event))
            await dst.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR, message=b"replica failed")
            return
        await dst.close(code=sendable(code), message=reason.encode()[:MAX_REASON])

    tasks = [asyncio.create_task(forward(client, upstream)), asyncio.create_task(forward(upstream, client))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:   # a handler cancelled (the front shutting down) leaves no pump behind
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sendable(code: int | None) -> int:
    """A close code as one side's close frame may carry it: 1005 (none given), 1006 (no close frame) and 1015
    (TLS) only describe a close, RFC 6455 7.4.1; those, and none, close 1000."""
    if code is None or code < 1000 or code in (1005, 1006, 1015):
        return aiohttp.WSCloseCode.OK
    return code
