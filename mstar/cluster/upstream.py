"""What the front tells a client when a replica did not answer, and a
replica's refusal of a websocket passed on whole.

A failure before a replica's answer began is one of three: the front could
not connect (nothing reached the replica: the request goes to another), the
connection dropped after the request went out (`replica_failed`, 502: it may
have had effects, so it is not sent again), or the replica went silent for
the front's read timeout (`replica_timeout`, 504). Each is an error body of
the replicas' own shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

# headers that describe one hop's connection, not the message (RFC 9110 7.6.1), and those aiohttp sets itself;
# Host passes on: a replica's same-origin check compares it with the page's Origin
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length"})
# connecting failed or took too long: the request never reached the replica (the session connects before it sends)
NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# a replica's answers that say it did not begin on the request: its waiting line is full (429), or it is
# stopping or its engine is down (503). A request the front can send again goes to another replica instead
NOT_BEGUN = frozenset({429, 503})
# a body with a Content-Length this small is read whole before it is passed on, so that a refusal can send it
# again (a chat or speech request); a larger one, or one streamed in without a length (NDJSON text into speech),
# passes through unbuffered and is never sent twice
REPLAYABLE_BYTES = 1 << 20
# as the replicas' own --body-timeout default: a body the front reads whole must have arrived by then (408)
BODY_TIMEOUT_S = 60.0


def replayable(request: web.Request) -> bool:
    """Whether the front reads `request`'s body whole before passing it on."""
    length = request.content_length
    return request.body_exists and length is not None and length <= REPLAYABLE_BYTES


async def read_held(request: web.Request) -> bytes | None:
    """A `replayable` body, read whole; None when it did not arrive within
    `BODY_TIMEOUT_S` (its stream is failed then, so that aiohttp waits for
    no more of it once the answer is sent)."""
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        request.content.set_exception(ConnectionResetError("the request body is overdue"))
        return None


def body_overdue() -> web.Response:
    """The answer to a body `read_held` gave up on; the connection closes."""
    response = error_response(408, "request_timeout",
                              f"the request body did not finish arriving within {BODY_TIMEOUT_S:g} s")
    response.force_close()
    return response


def could_not_connect(error: BaseException) -> bool:
    """The request never reached the replica: safe to send to another."""
    return isinstance(error, NOT_CONNECTED)


def went_silent(error: BaseException) -> bool:
    """The replica sent nothing for the front's read timeout (not a connect timeout)."""
    return isinstance(error, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)) and not could_not_connect(error)


def error_response(status: int, code: str, message: str, retry_after: bool = False) -> web.Response:
    """An error of the replicas' shape, typed as they type a status (`http/responses`; no mstar import here)."""
    headers = {"Retry-After": "1"} if retry_after else None
    return web.json_response({"error": {"message": message, "type": "server_error" if status >= 500 else
                                        "invalid_request_error", "param": None, "code": code}},
                             status=status, headers=headers)


def unavailable() -> web.Response:
    return error_response(503, "unavailable", "no replica is available", retry_after=True)


def failed_before_answer(error: BaseException) -> web.Response:
    """The replica took the request, then dropped it or went silent before its answer began."""
    if went_silent(error):
        return error_response(504, "replica_timeout", "the replica serving this request stopped answering; "
                                                      "send it again")
    return error_response(502, "replica_failed", "the replica serving this request failed; send it again")


class Refused(Exception):
    """A replica answered a websocket handshake with an HTTP response (401,
    404, 429, 503...), or a request with one of `NOT_BEGUN`: its status,
    headers and body, for the client as they are."""

    def __init__(self, status: int, reason: str | None, headers: list[tuple[str, str]], body: bytes) -> None:
        super().__init__(f"replica refused: {status}")
        self.status, self.reason, self.headers, self.body = status, reason, headers, body

    def response(self) -> web.Response:
        response = web.Response(status=self.status, reason=self.reason, body=self.body)
        for k, v in self.headers:
            if k.lower() not in HOP_HEADERS:
                response.headers.add(k, v)
        return response


async def keep_refusal(response: aiohttp.ClientResponse) -> None:
    """The front session's `raise_for_status`: a websocket handshake answered
    with anything but 101 raises `Refused` with the body read, which aiohttp's
    own handshake error drops. Other requests pass untouched (the front sends
    no Upgrade header on them)."""
    upgrade = response.request_info.headers.get("Upgrade", "")
    if response.status == 101 or upgrade.lower() != "websocket":
        return
    body = await response.read()
    raise Refused(response.status, response.reason, list(response.headers.items()), body)
