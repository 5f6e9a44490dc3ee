"""PCM16 in, the client's audio format out: chunk by chunk as it is
produced, or as one file once the whole waveform is there.

Each encoder turns little-endian mono PCM16 into bytes that can go on the
wire at once: `start()` before any audio (a WAV header), `push(pcm)` per
chunk, `finish()` at the end. Nothing waits for the whole waveform:

- `pcm`: the samples as they are.
- `wav`: a header whose RIFF and data sizes are 0xFFFFFFFF (the streaming
  convention: "until the end of the stream"), then the samples.
- `flac`, `mp3`, `opus` (Ogg Opus): libsndfile through `soundfile` (its wheels
  ship the codecs), writing into a sink that hands out each encoded frame as
  soon as the codec emits it. Headers the codec would patch on close
  (FLAC's total sample count and MD5) stay at "unknown", as in any FLAC stream.

`encode_whole` is for an answer sent once all its audio exists: the same
formats, with the true sizes in their headers (WAV's RIFF and data sizes,
FLAC's total sample count and MD5, MP3's LAME tag), so readers that trust
the header (Python's `wave`, `soundfile`) get the right duration.

No torch here; `soundfile` is imported only when a compressed format is used.
"""

from __future__ import annotations

from typing import Any, Protocol

from mstar.errors import RequestError

SAMPLE_WIDTH = 2  # bytes per PCM16 sample
UNKNOWN_SIZE = 0xFFFFFFFF

# response_format -> Content-Type
CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
# response_format -> (libsndfile major format, subtype) for the codecs libsndfile has
_SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
# LAME's quality knob in libsndfile (0 best); 0.5 is about 80 kbit/s at 24 kHz, plenty for speech
MP3_COMPRESSION_LEVEL = 0.5
# Ogg pages close after this much audio; libsndfile's default (1 s) would hold audio back that long
OGG_PAGE_LATENCY_MS = 100.0
# libsndfile writes no readable FLAC, MP3 or Ogg Opus file of no samples (an empty one, or headers alone): an
# answer with no audio at all (a budget that ends before the first frame) is a file of one silent sample
EMPTY_ANSWER_SAMPLES = 1
REFUSED = {"aac": "no AAC encoder is available"}


class AudioEncoder(Protocol):
    content_type: str

    def start(self) -> bytes: ...

    def push(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def check_format(name: str, field: str = "response_format") -> None:
    """Raise a 400 naming `field` unless `name` can be encoded here."""
    if name in REFUSED:
        raise RequestError(f"'{name}' is not supported: {REFUSED[name]}; use one of {sorted(CONTENT_TYPES)}",
                           field=field)
    if name not in CONTENT_TYPES:
        raise RequestError(f"must be one of {sorted(CONTENT_TYPES)}, got '{name}'", field=field)
    if name in _SOUNDFILE_FORMATS and not _soundfile_has(name):
        raise RequestError(f"'{name}' is not available on this server (its soundfile/libsndfile lacks the "
                           "codec); use 'wav' or 'pcm'", field=field)


def encoder_for(name: str, sample_rate: int) -> AudioEncoder:
    """An encoder for a format that `check_format` accepted."""
    if name == "pcm":
        return PcmEncoder()
    if name == "wav":
        return WavEncoder(sample_rate)
    return SoundFileEncoder(name, sample_rate)


def wav_header(sample_rate: int, data_bytes: int | None = None, channels: int = 1) -> bytes:
    """A 44-byte PCM16 WAV header; `data_bytes` None writes the unknown-length
    sizes a streamed WAV carries (players read until the stream ends)."""
    block_align = channels * SAMPLE_WIDTH
    if data_bytes is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = data_bytes
        riff_size = min(36 + data_bytes, UNKNOWN_SIZE)
    return b"".join((
        b"RIFF", riff_size.to_bytes(4, "little"), b"WAVE",
        b"fmt ", (16).to_bytes(4, "little"),
        (1).to_bytes(2, "little"),                      # PCM
        channels.to_bytes(2, "little"),
        sample_rate.to_bytes(4, "little"),
        (sample_rate * block_align).to_bytes(4, "little"),  # byte rate
        block_align.to_bytes(2, "little"),
        (8 * SAMPLE_WIDTH).to_bytes(2, "little"),
        b"data", data_size.to_bytes(4, "little"),
    ))


def encode_whole(name: str, sample_rate: int, pcm: bytes) -> bytes:
    """The whole waveform as one file of a format `check_format` accepted."""
    if name == "pcm":
        return pcm
    if name == "wav":
        return wav_header(sample_rate, len(pcm)) + pcm
    import io

    import numpy as np
    import soundfile

    fmt, subtype = _SOUNDFILE_FORMATS[name]
    out = io.BytesIO()  # seekable: libsndfile goes back to write the true sizes on close
    samples = np.frombuffer(pcm[:len(pcm) - len(pcm) % SAMPLE_WIDTH], dtype="<i2")
    with soundfile.SoundFile(out, mode="w", samplerate=sample_rate, channels=1, format=fmt, subtype=subtype,
                             **_soundfile_options(name)) as file:
        file.write(samples if len(samples) else np.zeros(EMPTY_ANSWER_SAMPLES, dtype="<i2"))
    return out.getvalue()


class PcmEncoder:
    """Raw PCM16 little-endian, passed through."""

    content_type = CONTENT_TYPES["pcm"]

    def start(self) -> bytes:
        return b""

    def push(self, pcm: bytes) -> bytes:
        return pcm

    def finish(self) -> bytes:
        return b""


class WavEncoder(PcmEncoder):
    """The header first (sizes unknown), then the samples as they come."""

    content_type = CONTENT_TYPES["wav"]

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    def start(self) -> bytes:
        return wav_header(self.sample_rate)


class StreamSink:
    """A write-only file for libsndfile that hands out what was written.

    libsndfile seeks: it asks for the length, and on close it goes back to
    patch headers. Bytes already taken (sent) cannot change any more, so a
    write before `sent` is dropped; writes into what is still pending land
    in place.
    """

    def __init__(self, skip_placeholder: bool = False) -> None:
        self.sent = 0                 # file offset of pending[0]
        self.pending = bytearray()
        self.pos = 0
        self.size = 0
        # A first write that is a frame header and zeros is a placeholder the
        # codec fills in on close (LAME's tag frame); sent as zeros it would
        # be a broken frame, so it is counted as sent and never goes out.
        self.skip_placeholder = skip_placeholder

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.size)[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        data = bytes(data)
        start, end = self.pos, self.pos + len(data)
        if self.skip_placeholder:
            self.skip_placeholder = False
            if start == 0 and self.size == 0 and len(data) > 4 and not any(data[4:]):
                self.sent = self.pos = self.size = end
                return len(data)
        if end > self.sent:
            if start < self.sent:  # the head of this write patches bytes already sent
                data, start = data[self.sent - start:], self.sent
            at = start - self.sent
            if at > len(self.pending):
                self.pending.extend(bytes(at - len(self.pending)))
            self.pending[at:at + len(data)] = data
        self.pos = end
        self.size = max(self.size, end)
        return end - start

    def read(self, n: int = -1) -> bytes:
        return b""  # encoders never read back what they wrote

    def take(self) -> bytes:
        out = bytes(self.pending)
        self.sent += len(out)
        self.pending.clear()
        return out


class SoundFileEncoder:
    """FLAC, MP3 or Ogg Opus through libsndfile, frame by frame."""

    def __init__(self, name: str, sample_rate: int) -> None:
        import soundfile

        fmt, subtype = _SOUNDFILE_FORMATS[name]
        self.content_type = CONTENT_TYPES[name]
        self.sink = StreamSink(skip_placeholder=name == "mp3")
        self.file = soundfile.SoundFile(self.sink, mode="w", samplerate=sample_rate, channels=1,
                                        format=fmt, subtype=subtype, **_soundfile_options(name))
        self.carry = b""  # an odd byte left over from a chunk, completed by the next
        self.written = False
        if name == "opus":
            _set_ogg_page_latency(self.file, OGG_PAGE_LATENCY_MS)

    def start(self) -> bytes:
        return self.sink.take()

    def push(self, pcm: bytes) -> bytes:
        import numpy as np

        data = self.carry + pcm
        whole = len(data) - len(data) % SAMPLE_WIDTH
        self.carry = data[whole:]
        if whole:
            self.file.write(np.frombuffer(data[:whole], dtype="<i2"))
            self.written = True
        return self.sink.take()

    def finish(self) -> bytes:
        if not self.written:
            import numpy as np

            self.file.write(np.zeros(EMPTY_ANSWER_SAMPLES, dtype="<i2"))
        self.file.close()  # flushes the codec's last frames
        return self.sink.take()


def _soundfile_options(name: str) -> dict[str, Any]:
    if name != "mp3":
        return {}
    # Constant bitrate: without the LAME tag (never sent in a stream, see
    # StreamSink) a decoder can only size a stream by its bytes, exact only for CBR.
    return {"bitrate_mode": "CONSTANT", "compression_level": MP3_COMPRESSION_LEVEL}


def _soundfile_has(name: str) -> bool:
    try:
        import soundfile
    except (ImportError, OSError):  # OSError: the package is there but libsndfile is not
        return False
    return _SOUNDFILE_FORMATS[name][0] in soundfile.available_formats()


def _set_ogg_page_latency(file: Any, ms: float) -> None:
    """SFC_SET_OGG_PAGE_LATENCY_MS, which soundfile has no wrapper for; left
    at libsndfile's default where this soundfile's internals differ."""
    import soundfile

    try:
        value = soundfile._ffi.new("double*", ms)
        soundfile._snd.sf_command(file._file, 0x1302, value, soundfile._ffi.sizeof("double"))
    except AttributeError:
        pass
