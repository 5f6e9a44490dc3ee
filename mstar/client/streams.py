"""Streamed answers, read as they arrive: `AsyncStream` turns a body's JSON
events into result objects, `AsyncSpeechStream` a speech body into audio
chunks (PCM16 for `pcm` and `wav`) while it times the first audio. `Stream`
and `SpeechStream` are the same for the blocking `Client`.

Leaving a stream early (`aclose`, or `async with` around a `break`) closes
the connection, which the server takes as the client hanging up: it aborts
the request and frees what it held. A stream dropped unfinished and unclosed
(a bare `break` out of a `for`) is closed too, once it is garbage.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import aiohttp

from mstar.client.audio import DEFAULT_SAMPLE_RATE, PCM_FORMATS, SAMPLE_WIDTH, Speech, WavHeaderReader
from mstar.client.errors import MstarError, connection_error, error_from_event
from mstar.client.loop_thread import LoopThread

T = TypeVar("T")

# what a body read may raise when the connection fails or is cut short
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


def close_when_dropped(stream: object, response: aiohttp.ClientResponse) -> None:
    """Close `response` once `stream` is garbage. aiohttp keeps an unread
    response alive from its connection (the end-of-body callback), so a
    dropped stream would otherwise hold the server's request until the
    client closes, generating for nobody."""
    finalizer = weakref.finalize(stream, _close_on_loop, asyncio.get_running_loop(), response)
    finalizer.atexit = False  # at exit the client's own shutdown closes its connections


def _close_on_loop(loop: asyncio.AbstractEventLoop, response: aiohttp.ClientResponse) -> None:
    # the last reference may go on another thread (the blocking Client's caller); the transport is the loop's
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(response.close)
        except RuntimeError:  # closed meanwhile: its connections are gone with it
            pass


class AsyncStream(Generic[T]):
    """The events of one streamed answer, each parsed into a `T`. An error
    event (the request failed after the stream began) raises `MstarError`."""

    def __init__(self, response: aiohttp.ClientResponse, events: AsyncGenerator[dict[str, Any], None],
                 parse: Callable[[dict[str, Any]], T]) -> None:
        self._response = response
        self._events = events
        self._parse = parse
        close_when_dropped(self, response)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._response.release()
            raise
        except TRANSPORT_ERRORS as e:
            await self.aclose()
            raise connection_error(e) from e
        except ValueError as e:  # a line that is not JSON: not an mstar server, or a broken proxy
            await self.aclose()
            raise MstarError(f"a streamed event is not JSON: {e}", code="invalid_response") from e
        if "error" in event:
            await self.aclose()
            raise error_from_event(event)
        return self._parse(event)

    async def aclose(self) -> None:
        await self._events.aclose()
        self._response.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class AsyncSpeechStream:
    """A speech body as it arrives, one chunk per HTTP chunk the server wrote
    (for Orpheus, a codec window). For `pcm` and `wav` every chunk holds whole
    PCM16 samples (a WAV's header is read off first and sets `sample_rate`
    and `channels`); other formats come as their encoded bytes.

    `ttfa` is set at the first audio; `collect()` reads what is left and
    returns the whole `Speech`, the chunks already iterated included.
    """

    def __init__(self, response: aiohttp.ClientResponse, response_format: str, sent_at: float) -> None:
        self.format = response_format
        # Raw PCM carries no rate of its own; the server gives it in this header.
        self.sample_rate = int(response.headers.get("X-Sample-Rate") or DEFAULT_SAMPLE_RATE)
        self.channels = 1
        self.ttfa: float | None = None
        self.elapsed: float | None = None
        self._response = response
        self._chunks = response.content.iter_chunks()
        self._sent_at = sent_at
        self._header = WavHeaderReader() if response_format == "wav" else None
        self._partial = bytearray()  # an HTTP chunk that arrived in pieces
        self._carry = b""            # bytes of a sample split across chunks
        self._pieces: list[bytes] = []
        self._done = False
        close_when_dropped(self, response)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        while not self._done:
            try:
                data, end_of_chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                self._done = True
                self.elapsed = time.perf_counter() - self._sent_at
                self._response.release()
                data, end_of_chunk = b"", True
            except TRANSPORT_ERRORS as e:
                await self.aclose()
                raise connection_error(e) from e
            self._partial += data
            if not end_of_chunk:
                continue
            piece = self._audio(bytes(self._partial))
            self._partial.clear()
            if piece:
                if self.ttfa is None:
                    self.ttfa = time.perf_counter() - self._sent_at
                self._pieces.append(piece)
                return piece
        raise StopAsyncIteration

    def _audio(self, data: bytes) -> bytes:
        """The audio in `data`: past the WAV header, in whole samples."""
        if self._header is not None:
            fmt = self._header.feed(data)
            if fmt is None:
                return b""
            self.sample_rate, self.channels = fmt.sample_rate, fmt.channels
            data, self._header = self._header.rest, None
        if self.format not in PCM_FORMATS:
            return data
        data = self._carry + data
        cut = len(data) - len(data) % (SAMPLE_WIDTH * self.channels)
        self._carry = data[cut:]
        return data[:cut]

    async def collect(self) -> Speech:
        async for _ in self:
            pass
        return Speech(audio=b"".join(self._pieces), format=self.format, sample_rate=self.sample_rate,
                      channels=self.channels, ttfa=self.ttfa,
                      elapsed=self.elapsed if self.elapsed is not None else time.perf_counter() - self._sent_at)

    async def aclose(self) -> None:
        self._done = True
        self._response.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class Stream(Generic[T]):
    """`AsyncStream` for the blocking `Client`: each item is read on the
    client's loop thread while this thread waits."""

    def __init__(self, runner: LoopThread, stream: AsyncStream[T]) -> None:
        self._runner = runner
        self._stream = stream
        self._items = runner.iterate(stream)

    def __iter__(self) -> Iterator[T]:
        return self._items

    def __next__(self) -> T:
        return next(self._items)

    def close(self) -> None:
        self._runner.run(self._stream.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class SpeechStream:
    """`AsyncSpeechStream` for the blocking `Client`: audio chunks as they
    arrive, then `collect()` for the whole `Speech`."""

    def __init__(self, runner: LoopThread, stream: AsyncSpeechStream) -> None:
        self._runner = runner
        self._stream = stream
        self._chunks = runner.iterate(stream)

    @property
    def ttfa(self) -> float | None:
        return self._stream.ttfa

    @property
    def sample_rate(self) -> int:
        return self._stream.sample_rate

    @property
    def channels(self) -> int:
        return self._stream.channels

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def __next__(self) -> bytes:
        return next(self._chunks)

    def collect(self) -> Speech:
        return self._runner.run(self._stream.collect())

    def close(self) -> None:
        self._runner.run(self._stream.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
