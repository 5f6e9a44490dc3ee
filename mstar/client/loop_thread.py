"""Coroutines in, their results out, on a private event loop in a daemon
thread: what lets the blocking `Client` reuse `AsyncClient` and still work
where the caller's thread already runs a loop (a Jupyter kernel), since
nothing here calls `asyncio.run` or touches the caller's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "mstar-client") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the private loop and wait for its result here."""
        if threading.current_thread() is self._thread:
            coro.close()
            # Waiting on our own loop from inside it would never return.
            raise RuntimeError("a blocking mstar Client was called from its own loop; use AsyncClient there")
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("this mstar Client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C (or any interrupt of the wait) must not leave the request running.
            future.cancel()
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator's items, each awaited on the private loop."""
        while True:
            try:
                yield self.run(_next(items))
            except StopAsyncIteration:
                return

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _next(items: AsyncIterator[T]) -> T:
    return await items.__anext__()
