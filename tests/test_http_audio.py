"""The streaming audio encoders of mstar/http/speech/audio.py: WAV headers read back
with the stdlib `wave`, PCM passed through, FLAC decoded back to the same
samples, MP3 and Ogg Opus decoded to the same sound; every format fed in
uneven chunks (odd byte counts included) as the engine's chunks arrive."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from mstar.errors import RequestError
from mstar.http.speech.audio import (CONTENT_TYPES, StreamSink, UNKNOWN_SIZE, check_format, encoder_for, wav_header)

soundfile = pytest.importorskip("soundfile")

RATE = 24_000


def speechlike(seconds: float = 1.5, seed: int = 0) -> np.ndarray:
    """A chirp under a slow envelope plus a little noise: no period, so a
    lossy codec's output lines up with it at one lag only."""
    t = np.arange(int(seconds * RATE)) / RATE
    chirp = np.sin(2 * np.pi * (150 * t + 400 * t * t))
    envelope = 0.3 + 0.2 * np.sin(2 * np.pi * 1.5 * t)
    noise = np.random.default_rng(seed).normal(0, 0.01, t.shape)
    return np.round((chirp * envelope + noise) * 32767 * 0.8).astype("<i2")


def pieces(pcm: bytes, sizes: tuple[int, ...] = (4096, 1, 999, 2048, 3)) -> list[bytes]:
    """`pcm` cut into uneven pieces, some of odd length."""
    out, at, i = [], 0, 0
    while at < len(pcm):
        n = sizes[i % len(sizes)]
        out.append(pcm[at:at + n])
        at, i = at + n, i + 1
    return out


def encode(fmt: str, pcm: bytes) -> tuple[bytes, list[bytes]]:
    """The whole stream, and what came out at each step (start, pushes, finish)."""
    enc = encoder_for(fmt, RATE)
    out = [enc.start()] + [enc.push(p) for p in pieces(pcm)] + [enc.finish()]
    return b"".join(out), out


def test_wav_header_fields() -> None:
    header = wav_header(RATE)
    assert len(header) == 44 and header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    riff, = struct.unpack_from("<I", header, 4)
    fmt_len, tag, channels, rate, byte_rate, align, bits = struct.unpack_from("<IHHIIHH", header, 16)
    assert riff == UNKNOWN_SIZE and (fmt_len, tag, channels, rate, byte_rate, align, bits) == (
        16, 1, 1, RATE, 2 * RATE, 2, 16)
    assert header[36:40] == b"data" and struct.unpack_from("<I", header, 40)[0] == UNKNOWN_SIZE
    sized = wav_header(RATE, data_bytes=1000)
    assert struct.unpack_from("<I", sized, 4)[0] == 1036 and struct.unpack_from("<I", sized, 40)[0] == 1000


def test_wav_streams_header_first_then_the_samples() -> None:
    pcm = speechlike(0.5).tobytes()
    whole, steps = encode("wav", pcm)
    assert steps[0] == wav_header(RATE)  # before any audio was pushed
    assert whole[44:] == pcm
    # with the unknown sizes patched to the real ones, the stdlib reads it back
    patched = bytearray(whole)
    struct.pack_into("<I", patched, 4, len(whole) - 8)
    struct.pack_into("<I", patched, 40, len(pcm))
    with wave.open(io.BytesIO(bytes(patched))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, RATE, len(pcm) // 2)
        assert w.readframes(w.getnframes()) == pcm
    # and soundfile reads the streamed form as it is, unknown sizes and all
    data, rate = soundfile.read(io.BytesIO(whole), dtype="int16")
    assert rate == RATE and data.tobytes() == pcm


def test_pcm_passes_through() -> None:
    pcm = speechlike(0.2).tobytes()
    whole, steps = encode("pcm", pcm)
    assert whole == pcm and steps[0] == b"" and steps[-1] == b""
    assert encoder_for("pcm", RATE).content_type == "audio/pcm"


def _streaminfo_total(flac: bytearray, total: int) -> None:
    """Write `total` samples into STREAMINFO (its low 36 bits at byte 8 + 13)."""
    assert flac[:4] == b"fLaC" and flac[4] & 0x7F == 0  # the first block is STREAMINFO
    field = int.from_bytes(flac[18:26], "big")
    flac[18:26] = ((field & ~((1 << 36) - 1)) | total).to_bytes(8, "big")


def test_flac_is_lossless_and_comes_out_while_audio_goes_in() -> None:
    x = speechlike(2.0)
    whole, steps = encode("flac", x.tobytes())
    assert whole[:4] == b"fLaC"
    # frames leave as the codec completes them, not all at the end
    assert sum(len(s) for s in steps[:-1]) > len(whole) // 2
    # a stream's STREAMINFO says "total unknown" (0); the rest decodes as is
    flac = bytearray(whole)
    field = int.from_bytes(flac[18:26], "big")
    assert field >> 44 == RATE and field & ((1 << 36) - 1) == 0
    _streaminfo_total(flac, len(x))  # soundfile's reader wants a total
    data, rate = soundfile.read(io.BytesIO(bytes(flac)), dtype="int16")
    assert rate == RATE and np.array_equal(data, x)


def _aligned_correlation(decoded: np.ndarray, x: np.ndarray) -> tuple[float, int]:
    """The best correlation of `decoded` with `x` over codec delays."""
    n = len(x) - 4000
    best = (-1.0, 0)
    for lag in range(0, min(3000, len(decoded) - n)):
        c = float(np.corrcoef(decoded[lag:lag + n].astype(float), x[:n].astype(float))[0, 1])
        best = max(best, (c, lag))
    return best


@pytest.mark.parametrize("fmt, magic", [("mp3", b"\xff"), ("opus", b"OggS")])
def test_lossy_formats_decode_to_the_same_sound(fmt: str, magic: bytes) -> None:
    x = speechlike(2.0)
    whole, steps = encode(fmt, x.tobytes())
    assert whole.startswith(magic)
    assert sum(len(s) for s in steps[:-1]) > len(whole) // 2  # streamed, not held to the end
    data, rate = soundfile.read(io.BytesIO(whole), dtype="int16")
    assert rate == RATE
    # codec delay and padding only: no frame lost or made up
    assert len(x) <= len(data) <= len(x) + 3000
    corr, lag = _aligned_correlation(data, x)
    assert corr > 0.95, (corr, lag)


def test_mp3_never_sends_the_tag_placeholder() -> None:
    whole, _ = encode("mp3", speechlike(0.5).tobytes())
    # LAME's tag frame is zeros until close; the stream starts at a real frame
    assert any(whole[4:200])


def test_no_audio_at_all() -> None:
    assert encode("wav", b"")[0] == wav_header(RATE)
    assert encode("pcm", b"")[0] == b""
    # libsndfile writes FLAC and MP3 headers with the first samples: without any, nothing
    for fmt in ("flac", "mp3", "opus"):
        encode(fmt, b"")


def test_sink_keeps_patches_to_unsent_bytes_and_drops_the_rest() -> None:
    sink = StreamSink()
    sink.write(b"abcdef")
    sink.seek(1)
    sink.write(b"XY")                    # not sent yet: lands in place
    sink.seek(0, 2)
    assert sink.take() == b"aXYdef" and sink.tell() == 6
    sink.write(b"gh")
    sink.seek(4)
    sink.write(b"ZZZ")                   # 4, 5 were sent: only the byte at 6 lands
    assert sink.take() == b"Zh"
    assert sink.seek(0, 2) == 8


def test_formats() -> None:
    for fmt in CONTENT_TYPES:
        check_format(fmt)
    with pytest.raises(RequestError) as e:
        check_format("aac")
    assert e.value.field == "response_format" and "not supported" in e.value.message
    with pytest.raises(RequestError) as e:
        check_format("ogg")
    assert e.value.field == "response_format"
