"""A request's media, decoded off the event loop: an `input_audio.data`
base64 string or an `image_url.url` data URL goes in, a numpy array comes
back (mono float32 audio at the encoder's rate; RGB uint8 [H, W, 3] images),
or a `RequestError` naming the field.

Decoding a minute of 48 kHz stereo WAV takes about a quarter of a second, a
4k PNG's data URL half a second or more: on the event loop that would stall
every stream it serves. Threads would not do: base64 decoding holds the GIL
throughout (a 4k PNG's 23 MB of base64 on a thread stalls the loop about as
long as it runs, 0.16 s), and so do parts of the audio path. So the work
runs in a small pool of spawned processes. The pool starts with the first
decode, not with the server, grows to `workers` processes only as decodes
overlap, and the app's cleanup shuts it down.

What crosses the process boundary is pickled through a pipe by the pool's own
threads, never by the event loop: the base64 text in, the array out. That
costs latency, not loop time: on a loaded 2-core box, 60 s of audio is 15 MB
of base64 in (~0.1 s) and 3.8 MB of float32 out (~10 ms); a 4k image 23 MB
in and 25 MB out (~0.1-0.2 s each way). Only the pickling's bulk copies hold
the GIL (~13 ms for 25 MB), which is what the event loop feels of a decode:
its worst lag measured 11-13 ms for the audio and 40-50 ms for the image
there (the OS deschedules a thread mid-copy on a busy box), against the
0.25 s and 0.58 s it stalls for decoding them itself. Shared memory would
spare the pipe, but /dev/shm is 64 MB in a default container.

A worker that dies (a decoder crash, the kernel's OOM killer) breaks the
pool and every decode in it: the pool is replaced and those decodes are tried
once more; one that breaks the new pool as well is taken to be the cause.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar.errors import RequestError

# the `input_audio.format` values a request may declare; the decoder reads the container from the bytes
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


def audio_format(value: object, field: str) -> str:
    """A declared `input_audio.format`, checked (a cheap check, on the loop)."""
    if not isinstance(value, str) or value.lower() not in AUDIO_FORMATS:
        raise RequestError(f"must be one of {list(AUDIO_FORMATS)}, got {value!r}", field=field)
    return value.lower()


@dataclass(frozen=True)
class Decoders:
    """The functions the pool runs, importable by name (a spawned process
    finds them by it): `audio(data, field, *, rate, max_seconds)` and
    `image(url, field, *, max_pixels)`."""

    audio: Callable[..., np.ndarray]
    image: Callable[..., np.ndarray]


def model_decoders() -> Decoders:
    """The model side's decoders, reached through the engine's package."""
    from mstar.engine import media_decoders

    audio, image = media_decoders()
    return Decoders(audio=audio, image=image)


class MediaDecoder:
    """Decodes a request's media in `workers` helper processes at most."""

    def __init__(self, workers: int, decoders: Decoders | None = None) -> None:
        if workers < 1:
            raise ValueError(f"a media decoder needs at least one worker, got {workers}")
        self.workers = workers
        # resolved now, so the first request does not import the decoders' libraries on the loop
        self._decoders = decoders or model_decoders()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    async def audio(self, data: str, field: str, *, max_seconds: float, rate: int = 16000) -> np.ndarray:
        """`data` (base64 audio in a format of AUDIO_FORMATS) as mono float32
        at `rate` Hz; refused past `max_seconds`."""
        if not isinstance(data, str):
            raise RequestError("must be a base64 string", field=field)
        return await self._run(self._decoders.audio, data, field, rate=rate, max_seconds=max_seconds)

    async def image(self, url: str, field: str, *, max_pixels: int) -> np.ndarray:
        """The image of a data URL as RGB uint8 [H, W, 3]; refused past
        `max_pixels` before it is decoded."""
        if not isinstance(url, str):
            raise RequestError("must be a string URL", field=field)
        return await self._run(self._decoders.image, url, field, max_pixels=max_pixels)

    async def close(self) -> None:
        """Stops the pool: decodes not yet started are cancelled, running ones
        finish first (in a thread, so the loop serves on meanwhile)."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        if self._closed:
            raise RuntimeError("the media decoder is closed")
        if self._pool is None:
            # spawned, not forked: a fork would copy the server's threads' locks (and its CUDA context) mid-use
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    async def _run(self, fn: Callable[..., np.ndarray], payload: str, field: str, **limits: Any) -> np.ndarray:
        pool = self._executor()
        try:
            return await asyncio.wrap_future(pool.submit(fn, payload, field, **limits))
        except BrokenProcessPool:
            self._replace(pool)
        pool = self._executor()
        try:
            return await asyncio.wrap_future(pool.submit(fn, payload, field, **limits))
        except BrokenProcessPool:
            self._replace(pool)
            raise RequestError("could not be decoded: the decoder process died on it", field=field) from None

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        # several decodes see the same pool break; only the first replaces it
        if self._pool is broken:
            self._pool = None
            broken.shutdown(wait=False, cancel_futures=True)
