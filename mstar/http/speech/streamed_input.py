"""The later lines of a streamed speech body in, text appended to its running
engine request out.

An `application/x-ndjson` body of `POST /v1/audio/speech` keeps arriving
while the audio streams out. Each later line, `{"input": "more text"}`, is
checked as the first line's `input` is (`parse_more_input`) and by the engine
(`Engine.append`: the request's context must have room for it), then spoken
after what came before. The end of the body ends the input. A bad line ends
the whole request: the engine request is aborted and `error` keeps the
`RequestError`, naming the field and the line, for the route to tell the
client however it still can.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from mstar.errors import RequestError
from mstar.http.speech.protocol import parse_more_input

if TYPE_CHECKING:
    from mstar.engine.engine import Engine

log = structlog.get_logger("mstar.http")


class StreamedInput:
    """Reads the rest of a body in a task of its own until the body ends,
    the input is refused, or `cancel()`."""

    def __init__(self, request: web.Request, engine: Engine, request_id: str) -> None:
        self.error: RequestError | None = None
        self._engine = engine
        self._request_id = request_id
        self._task = asyncio.get_running_loop().create_task(self._read(request))

    def refused(self, finish_reason: str | None) -> RequestError | None:
        """Why the request ended, if it ended because its input was refused
        (then it was aborted here; another end keeps its own reason)."""
        return self.error if finish_reason == "abort" else None

    def cancel(self) -> None:
        self._task.cancel()

    async def _read(self, request: web.Request) -> None:
        number = 1  # the body's first line is the request itself
        try:
            while line := await request.content.readline():
                number += 1
                if line.strip():
                    self._append(line, number)
                if self.error is not None:
                    return
        except (ConnectionError, TimeoutError):  # the client hung up, or paused past --body-timeout
            pass
        except Exception as e:  # a line past the reader's limit, say: the request ends rather than waits on
            self._refuse(RequestError(f"the body could not be read: {type(e).__name__}: {e}", field="body"),
                         number + 1)
        finally:
            if self.error is None:
                self._engine.close_input(self._request_id)

    def _append(self, line: bytes, number: int) -> None:
        try:
            self._engine.append(self._request_id, {"text": parse_more_input(line)})
        except RequestError as e:
            self._refuse(e, number)

    def _refuse(self, e: RequestError, number: int) -> None:
        self.error = RequestError(f"{e.message} (line {number} of the body)", field=e.field, status=e.status,
                                  code=e.code)
        log.warning("streamed speech input refused; the request ends", request_id=self._request_id,
                    line=number, field=e.field, error=e.message)
        self._engine.abort(self._request_id)
