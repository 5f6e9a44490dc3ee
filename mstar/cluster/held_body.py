"""Request bodies the front reads whole before passing them on, so that a
replica's refusal (`upstream.NOT_BEGUN`) can send them to another: small
ones with a length, within a budget of held bytes shared by every request in
flight. A body streamed in as it is written (NDJSON text into speech), a
larger one, or one past the budget passes through unbuffered and is never
sent twice.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from mstar.cluster.upstream import error_response

REPLAYABLE_BYTES = 1 << 20      # a chat or speech request fits
HELD_BYTES = 256 << 20          # bodies held at once, all requests together: past it a body streams through
# the front's --body-timeout default, as the replicas' own: a held body must have arrived by then (408)
BODY_TIMEOUT_S = 60.0
# bodies that keep arriving while the answer streams out: a replica bounds only their idle time
STREAMED_IN = frozenset({("/v1/audio/speech", "application/x-ndjson")})


class BodyOverdue(TimeoutError):
    """Set on a held body's stream that did not arrive in time: aiohttp's read of what is left, after the 408,
    ends on it quietly (a timeout, as the replicas' own body deadline raises)."""


def replayable(request: web.Request, held: int) -> bool:
    """Whether the front reads `request`'s body whole, with `held` bytes held already."""
    length = request.content_length
    return (request.body_exists and length is not None and length <= REPLAYABLE_BYTES and held + length <= HELD_BYTES
            and (request.path, request.content_type) not in STREAMED_IN)


async def read_held(request: web.Request, timeout: float = BODY_TIMEOUT_S) -> bytes | None:
    """A `replayable` body, read whole; None when it did not arrive within
    `timeout` s (0: no limit; its stream is failed then, so that aiohttp
    waits for no more of it once the answer is sent)."""
    try:
        return await asyncio.wait_for(request.read(), timeout or None)
    except asyncio.TimeoutError:
        request.content.set_exception(BodyOverdue("the request body is overdue"))
        return None


def body_overdue(timeout: float) -> web.Response:
    """The answer to a body `read_held` gave up on after `timeout` s; the connection closes."""
    response = error_response(408, "request_timeout",
                              f"the request body did not finish arriving within {timeout:g} s (--body-timeout)")
    response.force_close()
    return response
