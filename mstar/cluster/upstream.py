"""The front's side of a replica: the headers a request goes on with, what
a client hears when a replica did not answer, and a replica's refusal passed
on whole (a websocket's, or a request's that a held body may send to another
replica instead: `refusal`).

A failure before a replica's answer began is one of three: the front could
not connect (nothing reached the replica: the request goes to another), the
connection dropped after the request went out (`replica_failed`, 502: it may
have had effects, so it is not sent again), or the replica went silent for
the front's read timeout (`replica_timeout`, 504). Each is an error body of
the replicas' own shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

# headers that describe one hop's connection, not the message (RFC 9110 7.6.1), and those aiohttp sets itself;
# Host passes on: a replica's same-origin check compares it with the page's Origin
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length"})
# connecting failed or took too long: the request never reached the replica (the session connects before it sends)
NOT_CONNECTED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# a replica's answers that may say it did not begin on the request: a 429 always does (its waiting line is full;
# RFC 6585), a 503 only with the code `unavailable` (stopping, or its engine down). A 503 `aborted` comes after
# work (a drain's end, a worker lost): it is passed on, not sent again
NOT_BEGUN = frozenset({429, 503})
REFUSAL_READ_S = 5.0   # a refusal's body is short: one that does not arrive by then is left out


def forwarded_headers(request: web.Request) -> dict[str, str]:
    """The request's headers for the replica: end-to-end ones, and who the client is."""
    named = {h.strip().lower() for h in request.headers.get("Connection", "").split(",")}   # hop-by-hop too
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS and k.lower() not in named}
    peer = request.remote
    if peer:
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    return headers


class NoAnswer(Exception):
    """The replica's answer never began: it could not be reached, it dropped the request, or it went silent."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


def could_not_connect(error: BaseException) -> bool:
    """The request never reached the replica: safe to send to another."""
    return isinstance(error, NOT_CONNECTED)


def went_silent(error: BaseException) -> bool:
    """The replica sent nothing for the front's read timeout (not a connect timeout)."""
    return isinstance(error, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)) and not could_not_connect(error)


def error_body(status: int, code: str, message: str) -> dict:
    """An error of the replicas' shape, typed as they type a status (`http/responses`; no mstar import here)."""
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": code}}


def error_response(status: int, code: str, message: str, retry_after: bool = False) -> web.Response:
    """`error_body` as a JSON response."""
    headers = {"Retry-After": "1"} if retry_after else None
    return web.json_response(error_body(status, code, message), status=status, headers=headers)


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
    headers and body, for the client as they are. `resend`: it said it did
    not begin on the request (`refusal`)."""

    def __init__(self, status: int, reason: str | None, headers: list[tuple[str, str]], body: bytes,
                 resend: bool = False) -> None:
        super().__init__(f"replica refused: {status}")
        self.status, self.reason, self.headers, self.body, self.resend = status, reason, headers, body, resend

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
    raise Refused(response.status, response.reason, list(response.headers.items()), body,
                  resend=not_begun(response.status, body))


def not_begun(status: int, body: bytes) -> bool:
    """Whether a replica's refusal says it did not begin: a 429, or a 503 with the code `unavailable`."""
    if status == 429:
        return True
    try:
        return status == 503 and json.loads(body)["error"]["code"] == "unavailable"
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return False


async def refusal(response: aiohttp.ClientResponse) -> Refused:
    """A `NOT_BEGUN` answer to a request, read: to be sent again where it
    says the replica did not begin (a body that could not be read leaves the
    answer bodiless, and a 503 undecided: not sent again)."""
    headers = list(response.headers.items())
    try:
        body = await asyncio.wait_for(response.read(), REFUSAL_READ_S)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        body, headers = b"", [(k, v) for k, v in headers if k.lower() != "content-encoding"]
    return Refused(response.status, response.reason, headers, body, resend=not_begun(response.status, body))
