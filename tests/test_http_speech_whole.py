"""`/v1/audio/speech` with `stream: false`: the whole audio in one answer of
known length, whose WAV or FLAC (MP3, Opus) header carries the true sizes, so
Python's `wave` and `soundfile.read` give the right duration; a streamed WAV
keeps the unknown-size header. The SDK's `Speech.to_wav` writes true sizes,
to a file object that cannot seek too."""

from __future__ import annotations

import io
import wave
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
import soundfile
from http_support import running_engine, serving

from mstar.client.audio import Speech
from mstar.http.speech.audio import UNKNOWN_SIZE

ON_LOOP = pytest.mark.asyncio(loop_scope="module")  # the server tests share one engine; the SDK one needs none

RATE = 24_000
# seeded, so every format encodes the same waveform
BODY = {"model": "orpheus-tiny", "input": "a whole answer.", "voice": "tara", "max_tokens": 49,
        "ignore_eos": True, "seed": 11}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url() -> AsyncIterator[str]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as base:
        yield base


async def _speech(url: str, **extra: object) -> tuple[aiohttp.ClientResponse, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", json={**BODY, **extra}) as r:
            return r, await r.read()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pcm(url: str) -> bytes:
    r, data = await _speech(url, response_format="pcm", stream=False)
    assert r.status == 200 and data and len(data) % 2 == 0
    return data


@ON_LOOP
async def test_a_whole_wav_has_true_sizes(url: str, pcm: bytes) -> None:
    r, data = await _speech(url, response_format="wav", stream=False)
    assert r.status == 200 and r.headers["Content-Type"] == "audio/wav"
    assert int(r.headers["Content-Length"]) == len(data) and "Transfer-Encoding" not in r.headers
    assert int.from_bytes(data[4:8], "little") == len(data) - 8  # RIFF size
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        assert w.getnframes() == len(pcm) // 2
        assert w.readframes(w.getnframes()) == pcm


@ON_LOOP
@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
async def test_soundfile_reads_the_true_duration(url: str, pcm: bytes, fmt: str) -> None:
    r, data = await _speech(url, response_format=fmt, stream=False)
    assert r.status == 200 and int(r.headers["Content-Length"]) == len(data)
    info = soundfile.info(io.BytesIO(data))
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and info.frames == len(samples) == len(pcm) // 2
    assert info.duration == pytest.approx(len(pcm) / 2 / RATE)


@ON_LOOP
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
async def test_an_answer_without_audio_is_still_a_file_of_its_format(url: str, fmt: str, stream: bool) -> None:
    """A budget that ends before the first frame: no audio at all. WAV holds
    none; FLAC, MP3 and Opus cannot be written empty, so they hold one silent
    sample (MP3's encoder pads what it streams with silence of its own)."""
    r, data = await _speech(url, response_format=fmt, stream=stream, max_tokens=1)
    assert r.status == 200
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and not samples.any()
    if not (stream and fmt == "mp3"):
        assert len(samples) == (0 if fmt == "wav" else 1)


@ON_LOOP
async def test_a_streamed_wav_keeps_the_unknown_size_header(url: str, pcm: bytes) -> None:
    r, data = await _speech(url, response_format="wav")
    assert r.status == 200 and r.headers.get("Transfer-Encoding") == "chunked"
    assert int.from_bytes(data[4:8], "little") == UNKNOWN_SIZE == int.from_bytes(data[40:44], "little")
    assert data[44:] == pcm


@ON_LOOP
async def test_stream_false_with_sse_is_refused(url: str) -> None:
    r, data = await _speech(url, stream=False, stream_format="sse")
    assert r.status == 400 and b'"param":"stream"' in data


class _Unseekable(io.RawIOBase):
    """A pipe-like target: writes only."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.data += b
        return len(b)


@pytest.mark.parametrize("target", [io.BytesIO, _Unseekable])
def test_sdk_to_wav_writes_true_sizes(target: type) -> None:
    pcm = bytes(range(256)) * 300
    out = target()
    Speech(audio=pcm, format="pcm", sample_rate=RATE, channels=1, ttfa=None, elapsed=0.0).to_wav(out)
    data = bytes(out.getvalue() if isinstance(out, io.BytesIO) else out.data)
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == len(pcm) // 2 and w.readframes(w.getnframes()) == pcm
    assert soundfile.info(io.BytesIO(data)).frames == len(pcm) // 2
