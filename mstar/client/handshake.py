"""A websocket upgrade in; the open socket, or the `MstarError` of why not, out.

aiohttp's `ws_connect` drops a refused upgrade's body and raises its own
errors (refused connection, read timeout, handshake), so a caller would have
three more types to catch and no server message. `open_websocket` maps them
as the HTTP calls do: a refusal carries the server's `{"error": {...}}` code,
message and param, its status and Retry-After; a connection that failed or
went silent has code `connection_error` or `timeout`.

The body is read by a trace hook (`refusal_trace`, installed on the client's
aiohttp session) while aiohttp still holds the response; a context variable,
set only around `open_websocket`'s own upgrade, says where to keep it.
"""

from __future__ import annotations

import types
from contextvars import ContextVar

import aiohttp

from mstar.client.errors import MstarError, connection_error, error_from_body
from mstar.client.streams import TRANSPORT_ERRORS

# a refusal whose body names no code (a proxy's page, an empty body) still gets one from its status
HANDSHAKE_CODES = {401: "invalid_api_key", 404: "model_not_found"}
MAX_REFUSAL_BYTES = 64 * 1024  # an error body is a few hundred bytes; a proxy's page need not be read whole
WS_CLOSE_S = 10.0              # aiohttp's own wait for the server's close frame

# where the upgrade running in this task keeps a refusal's body; None outside open_websocket
_refusal: ContextVar[bytearray | None] = ContextVar("mstar_ws_refusal", default=None)


def refusal_trace() -> aiohttp.TraceConfig:
    """The trace hook that keeps a refused upgrade's body for `open_websocket`."""
    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_keep_refusal)
    return trace


async def _keep_refusal(session: aiohttp.ClientSession, ctx: types.SimpleNamespace,
                        params: aiohttp.TraceRequestEndParams) -> None:
    kept = _refusal.get()
    if kept is None or params.response.status == 101:
        return
    content = params.response.content
    try:
        while len(kept) < MAX_REFUSAL_BYTES and (piece := await content.read(MAX_REFUSAL_BYTES - len(kept))):
            kept += piece
    except TRANSPORT_ERRORS:
        pass  # the status and headers still say what happened


async def open_websocket(http: aiohttp.ClientSession, url: str,
                         timeout: float | None) -> aiohttp.ClientWebSocketResponse:
    """The websocket at `url`. The upgrade's connect and read are bounded by
    the session's own timeout; closing the socket waits at most `timeout`
    (or 10 s) for the server's close frame, so a hung server can't hold it."""
    ws_close = WS_CLOSE_S if timeout is None else min(timeout, WS_CLOSE_S)
    kept = bytearray()
    token = _refusal.set(kept)
    try:
        return await http.ws_connect(url, max_msg_size=0,
                                     timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=ws_close))
    except aiohttp.WSServerHandshakeError as e:
        raise refused(e, bytes(kept)) from None
    except TRANSPORT_ERRORS as e:
        raise connection_error(e) from e
    finally:
        _refusal.reset(token)


def refused(e: aiohttp.WSServerHandshakeError, body: bytes) -> MstarError:
    """The error of a refused upgrade: the server's own when its body has one."""
    if e.status == 101:  # upgraded, but not as a websocket should be: not an mstar server, or a broken proxy
        return MstarError(f"the realtime handshake failed: {e.message}", code="handshake_failed")
    error = error_from_body(e.status, body, e.headers, f"the realtime session was refused (HTTP {e.status})")
    if error.code is None:
        error.code = HANDSHAKE_CODES.get(e.status, "handshake_failed")
    return error
