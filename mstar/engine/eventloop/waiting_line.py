"""The engine's waiting line: requests submitted that have produced nothing
yet (queued, or waiting for KV pages), bounded by `max_waiting_requests`.

A new request first waits for room (`admit`) up to the queue timeout, then
is refused with a 429 that asks the client to retry; a request leaves the
line at its first output or at its end (`started`). Event loop only.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from mstar.errors import SHUTTING_DOWN, RequestError


class WaitingLine:
    def __init__(self, limit: int, timeout: float, stats: Counter[str]) -> None:
        self.limit = limit
        self.timeout = timeout
        self.stats = stats
        self._waiting: set[str] = set()
        self._room: asyncio.Event | None = None
        self.closed = False  # the server is shutting down: no one gets in, waiting or new

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request_id: str) -> None:
        self._waiting.add(request_id)

    def clear(self) -> None:
        self._waiting.clear()

    def started(self, request_id: str) -> None:
        """`request_id` left the line (its first output, or its end)."""
        if request_id in self._waiting:
            self._waiting.discard(request_id)
            if self._room is not None and len(self._waiting) < self.limit:
                self._room.set()

    def close(self) -> None:
        """Refuse everyone from now on, those waiting for room included: room the drain makes by aborting
        running requests must not let in requests it would then have to cut."""
        self.closed = True
        if self._room is not None:
            self._room.set()

    async def admit(self, timeout: float | None = None) -> None:
        """Wait until fewer than `limit` requests are waiting, at most
        `timeout` seconds (default: the configured queue timeout); then raise
        a 429 asking the client to retry."""
        if self.closed:
            raise shutting_down()
        if len(self._waiting) < self.limit:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        if self._room is None:
            self._room = asyncio.Event()
        while len(self._waiting) >= self.limit and not self.closed:
            self._room.clear()
            left = deadline - loop.time()
            if left <= 0:
                self.stats["requests_refused_busy"] += 1
                raise RequestError(f"{len(self._waiting)} requests are waiting to start (the limit is "
                                   f"{self.limit}); retry shortly", status=429, code="queue_full", retry_after=1)
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                pass
        if self.closed:
            raise shutting_down()


def shutting_down() -> RequestError:
    return RequestError(SHUTTING_DOWN, status=503, code="unavailable", retry_after=5)
