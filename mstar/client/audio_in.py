"""Audio for a realtime session's input: a WAV file or an array of samples
in, 24 kHz mono PCM16 bytes out, and those bytes cut in chunks to send.

WAV files are read with the standard library (16-bit PCM); an array (numpy,
float in [-1, 1] or int16) needs its `rate`. Other rates and stereo are
mixed and resampled with numpy's linear interpolation: good enough for a
model's ears, and numpy is only imported when a conversion needs it.
"""

from __future__ import annotations

import os
import wave
from collections.abc import Iterator
from typing import Any, BinaryIO

from mstar.client.audio import DEFAULT_SAMPLE_RATE, SAMPLE_WIDTH

INPUT_RATE = DEFAULT_SAMPLE_RATE  # what a realtime session takes: 24 kHz mono PCM16
CHUNK_MS = 100


def pcm16_input(source: str | os.PathLike[str] | BinaryIO | Any, rate: int | None = None) -> bytes:
    """`source` as 24 kHz mono PCM16: a WAV file (path or binary file), or
    an array of samples at `rate` Hz (float in [-1, 1] or int16, mono, or
    [samples, channels])."""
    if hasattr(source, "dtype"):
        if rate is None:
            raise ValueError("an array of samples needs its rate")
        return _convert(source, rate)
    with wave.open(source if not isinstance(source, os.PathLike) else os.fspath(source), "rb") as w:
        if w.getsampwidth() != SAMPLE_WIDTH or w.getcomptype() != "NONE":
            raise ValueError("only 16-bit PCM WAV files can be sent")
        channels, wav_rate = w.getnchannels(), w.getframerate()
        data = w.readframes(w.getnframes())
    if channels == 1 and wav_rate == INPUT_RATE:
        return data
    import numpy as np

    samples = np.frombuffer(data, dtype=np.int16).reshape(-1, channels)
    return _convert(samples, wav_rate)


def chunks(pcm: bytes, chunk_ms: int = CHUNK_MS) -> Iterator[bytes]:
    """`pcm` in pieces of `chunk_ms` (the last may be shorter)."""
    step = INPUT_RATE * chunk_ms // 1000 * SAMPLE_WIDTH
    for start in range(0, len(pcm), step):
        yield pcm[start:start + step]


def _convert(samples: Any, rate: int) -> bytes:
    import numpy as np

    x = np.asarray(samples)
    scale = 32768.0 if x.dtype == np.int16 else 1.0
    x = x.astype(np.float32) / scale
    if x.ndim == 2:
        x = x.mean(axis=1)
    if x.ndim != 1:
        raise ValueError(f"audio must be mono or [samples, channels], got shape {x.shape}")
    if rate != INPUT_RATE and x.size:
        n = int(round(x.size * INPUT_RATE / rate))
        x = np.interp(np.arange(n) * (rate / INPUT_RATE), np.arange(x.size), x).astype(np.float32)
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()
