"""Speech audio: received bytes in, a `Speech` result out, and WAV files
written from it.

The server streams PCM16 little-endian (format `pcm`, its rate in the
`X-Sample-Rate` header) or a WAV whose header comes first; `WavHeaderReader`
reads that header off the front of a stream so the rest is plain PCM.
"""

from __future__ import annotations

import os
import wave
from dataclasses import dataclass
from typing import BinaryIO

SAMPLE_WIDTH = 2            # PCM16
DEFAULT_SAMPLE_RATE = 24_000  # what mstar's speech models play, for a server that does not say
PCM_FORMATS = frozenset({"pcm", "wav"})  # the formats whose chunks this client hands out as PCM


@dataclass(frozen=True)
class Speech:
    """A whole speech answer.

    `audio` is the body as received, less a WAV header: PCM16 for formats
    `pcm` and `wav`, the encoded stream for the others (`mp3`, `flac`, `opus`).
    `ttfa` is the time to first audio, seconds from sending the request to the
    first audio bytes; `elapsed` the same to the last byte. Both are measured
    here, on the client, so they include the network.
    """

    audio: bytes
    format: str
    sample_rate: int
    channels: int
    ttfa: float | None
    elapsed: float

    @property
    def pcm(self) -> bytes:
        """PCM16 little-endian samples (interleaved when `channels` > 1)."""
        if self.format not in PCM_FORMATS:
            raise ValueError(f"the audio is {self.format}, not PCM; ask for response_format 'pcm' or 'wav'")
        return self.audio

    @property
    def num_samples(self) -> int:
        """Samples per channel."""
        return len(self.pcm) // (SAMPLE_WIDTH * self.channels)

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return self.num_samples / self.sample_rate

    def to_wav(self, target: str | os.PathLike[str] | BinaryIO) -> None:
        """Write a complete WAV (sizes filled in, unlike a streamed one) to a
        path or a binary file object."""
        pcm = self.pcm
        # `wave` takes a path or a file object, but not a PathLike.
        with wave.open(os.fspath(target) if isinstance(target, os.PathLike) else target, "wb") as out:
            out.setnchannels(self.channels)
            out.setsampwidth(SAMPLE_WIDTH)
            out.setframerate(self.sample_rate)
            out.writeframes(pcm)


@dataclass(frozen=True)
class WavFormat:
    sample_rate: int
    channels: int


class WavHeaderReader:
    """Reads a WAV header off the front of a stream: `feed` bytes until it
    returns the format, then `rest` holds the first PCM bytes.

    Walks the RIFF chunks rather than assuming 44 bytes, so a header with
    extra chunks (LIST, fact) still parses.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.rest = b""

    def feed(self, data: bytes) -> WavFormat | None:
        self.buffer += data
        buf = self.buffer
        if len(buf) < 12:
            return None
        if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
            raise ValueError("the server's WAV stream does not start with a RIFF/WAVE header")
        pos, fmt = 12, None
        while len(buf) >= pos + 8:
            kind, size = bytes(buf[pos:pos + 4]), int.from_bytes(buf[pos + 4:pos + 8], "little")
            body = pos + 8
            if kind == b"data":
                if fmt is None:
                    raise ValueError("the server's WAV stream has no 'fmt ' chunk before its data")
                self.rest = bytes(buf[body:])
                return fmt
            if len(buf) < body + size:
                return None
            if kind == b"fmt ":
                bits = int.from_bytes(buf[body + 14:body + 16], "little")
                if bits != 8 * SAMPLE_WIDTH:
                    raise ValueError(f"the server's WAV stream has {bits}-bit samples; this client reads 16")
                fmt = WavFormat(sample_rate=int.from_bytes(buf[body + 4:body + 8], "little"),
                                channels=int.from_bytes(buf[body + 2:body + 4], "little"))
            pos = body + size + (size & 1)  # RIFF pads chunks to even sizes
        return None
