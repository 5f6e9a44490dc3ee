"""Python values out to the client: JSON answers, OpenAI-style error bodies,
and streamed events (server-sent `data:` frames or NDJSON lines)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import orjson
from aiohttp import web

from mstar.errors import RequestError
from mstar.http.submission import ClientGone

Framing = Literal["sse", "ndjson"]


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_type(status: int) -> str:
    """The OpenAI error `type` of an answer of `status`: clients read it for
    the class of fault (a 429's is OpenAI's for too many requests: come back
    after Retry-After)."""
    return "requests" if status == 429 else "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, *, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def request_error_body(err: RequestError) -> dict[str, Any]:
    # The field leads the message unless the message already starts with it.
    field = err.field
    message = err.message if field is None or err.message.startswith(field) else f"{field}: {err.message}"
    return error_body(message, status=err.status, param=err.field, code=err.code)


def error_response(message: str, *, status: int, param: str | None = None, code: str | None = None) -> web.Response:
    return json_response(error_body(message, status=status, param=param, code=code), status=status)


def client_gone(request: web.Request) -> Callable[[], bool]:
    """A check that the client has hung up (used while nothing is written)."""
    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()
    return gone


class EventStream:
    """A streamed answer, one event per `send`.

    SSE frames are `data: {json}\\n\\n` and end with `data: [DONE]`; NDJSON is
    one object per line. A write to a client that went away raises
    `ConnectionError`, which the caller takes as the signal to abort.
    """

    def __init__(self, response: web.StreamResponse, framing: Framing) -> None:
        self.response = response
        self.framing = framing

    @classmethod
    async def open(cls, request: web.Request, framing: Framing) -> EventStream:
        response = web.StreamResponse(status=200)
        if framing == "sse":
            response.content_type = "text/event-stream"
        else:
            response.content_type = "application/x-ndjson"
        response.charset = "utf-8"
        response.headers["Cache-Control"] = "no-cache"
        # Proxies such as nginx would otherwise hold tokens back in a buffer.
        response.headers["X-Accel-Buffering"] = "no"
        try:
            await response.prepare(request)
        except ConnectionError:  # the client left before the headers went out: a 499, as before any answer
            raise ClientGone() from None
        return cls(response, framing)

    async def send(self, obj: Any) -> None:
        data = orjson.dumps(obj)
        if self.framing == "sse":
            await self.response.write(b"data: " + data + b"\n\n")
        else:
            await self.response.write(data + b"\n")

    async def close(self) -> None:
        if self.framing == "sse":
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def fail(self, body: dict[str, Any]) -> None:
        """Report an error after the headers went out, then end the stream.
        The client may be gone already; then there is no one to tell."""
        try:
            await self.send(body)
            await self.close()
        except ConnectionError:
            pass
