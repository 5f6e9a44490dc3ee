"""`POST /v1/audio/speech` bodies in, a checked `SpeechBody` out.

OpenAI's fields (`model`, `input`, `voice`, `response_format`,
`stream_format`, `speed`, `instructions`) plus mstar's extensions: `stream`
(false: the whole audio in one answer of known length) and the sampling
fields (`max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `seed`, `ignore_eos`) and `sampling_by` (sampling
key -> fields, checked by the model). Sampling fields a client leaves
out take the model's defaults, so they are kept as overrides here and merged
once the model is known. The later lines of a streamed (NDJSON) body,
`{"input": "more text"}`, are checked as the first line's `input` is.
Anything malformed, unknown or unsupported raises `RequestError` naming the
field. Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mstar.http.speech.audio import check_format
from mstar.http.fields import Fields, read_voice
from mstar.http.text.protocol import SAMPLING_BY, parse_json_object

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
DEFAULT_FORMAT = "mp3"  # OpenAI's default

StreamFormat = Literal["audio", "sse"]

OPENAI_KEYS = frozenset({"model", "input", "voice", "response_format", "stream_format", "speed", "instructions"})
MORE_INPUT_KEYS = frozenset({"input"})
SAMPLING_INTS = ("max_tokens", "min_tokens", "top_k", "seed")
SAMPLING_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SAMPLING_KEYS = frozenset(SAMPLING_INTS + SAMPLING_NUMBERS + ("ignore_eos",))
SPEECH_KEYS = OPENAI_KEYS | SAMPLING_KEYS | {"stream", "early_audio", SAMPLING_BY}


@dataclass(frozen=True)
class SpeechBody:
    """A speech request; `voice` None is the model's default voice,
    `sampling` holds only the sampling fields the client gave (and
    `sampling_by` its sampling per key), and `stream` False asks for the
    whole audio in one answer. `early_audio` (an mstar extension) asks for
    the model's early walk: first audio sooner, its first frame decoded with
    less context (Orpheus: after 2 frames instead of 4)."""

    model: str | None
    input: str
    voice: str | None
    response_format: str
    stream_format: StreamFormat
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = True
    sampling_by: dict[str, dict[str, Any]] = field(default_factory=dict)
    early_audio: bool = False


def parse_speech(body: bytes) -> SpeechBody:
    f = Fields(parse_json_object(body))
    f.refuse_unknown(SPEECH_KEYS)
    fmt = f.string("response_format", DEFAULT_FORMAT) or DEFAULT_FORMAT
    check_format(fmt)
    stream_format = f.string("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise f.error("stream_format", f"must be 'audio' or 'sse', got '{stream_format}'")
    stream = f.boolean("stream", True)
    if not stream and stream_format == "sse":
        raise f.error("stream", "false asks for one answer, but stream_format 'sse' streams events")
    # Changing the tempo without changing the pitch needs a time-stretcher;
    # refused rather than faked with a resample that shifts the voice.
    speed = f.number("speed", 1.0)
    if speed != 1.0:
        raise f.error("speed", f"only 1.0 is supported, got {speed}")
    if f.string("instructions"):
        raise f.error("instructions", "voice instructions are not supported by the served speech models")
    return SpeechBody(
        model=f.string("model"),
        input=_read_input(f),
        voice=read_voice(f),
        response_format=fmt,
        stream_format=stream_format,  # type: ignore[arg-type]  # checked just above
        sampling=_read_sampling(f),
        stream=stream,
        sampling_by=f.sampling_by(SAMPLING_BY),
        early_audio=f.boolean("early_audio", False),
    )


def parse_more_input(line: bytes) -> str:
    """The text of a later line of a streamed body, `{"input": "more text"}`."""
    f = Fields(parse_json_object(line))
    f.refuse_unknown(MORE_INPUT_KEYS)
    return _read_input(f)


def _read_input(f: Fields) -> str:
    text = f.string("input")
    if text is None:
        raise f.error("input", "is required")
    if not text.strip():
        raise f.error("input", "must not be empty")
    if len(text) > MAX_INPUT_CHARS:
        raise f.error("input", f"must be at most {MAX_INPUT_CHARS} characters, got {len(text)}")
    return text


def _read_sampling(f: Fields) -> dict[str, Any]:
    """Only what the client gave, type-checked; ranges are checked by
    `SamplingParams.validate` once merged with the model's defaults."""
    out: dict[str, Any] = {}
    for key in SAMPLING_INTS:
        if f.has(key):
            out[key] = f.seed() if key == "seed" else f.integer(key, lo=1 if key == "max_tokens" else None)
    for key in SAMPLING_NUMBERS:
        if f.has(key):
            out[key] = f.number(key)
    if f.has("ignore_eos"):
        out["ignore_eos"] = f.boolean("ignore_eos")
    return out
