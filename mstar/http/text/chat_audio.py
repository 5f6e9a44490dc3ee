"""Chat answers spoken as well as written, in OpenAI's chat shapes.

In: a chat body's `modalities` and `audio` (`{"voice", "format"}`), read into
an `AudioOutput`, or None for a text answer. OpenAI's rules hold: asking for
"audio" in `modalities` needs `audio`, with both its fields; `audio` without
"audio" asked is refused; a streamed answer's audio is "pcm16" only; a spoken
answer has no logprobs. The voice is the model's to check (a 400 naming
`audio.voice` that lists its voices).

Out: a finished choice as `message.audio` (`id`, `data`: the whole audio in
the asked format, base64, `expires_at`, `transcript`: the answer's text)
with `content` null; streamed, each chunk's text and PCM16 as a `delta.audio`
piece (`id` with `transcript` and/or `data`), then an update of only
`expires_at`, then the choice's finish. A finished answer's transcript is
kept for later turns that name its audio id (`transcripts.py`) until its
`expires_at`. Usage tells the audio's tokens (the ones the talker sampled) from
the text's in `completion_tokens_details`. Importable without torch.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mstar.errors import RequestError
from mstar.http.fields import Fields, read_voice
from mstar.http.ids import uuid4_hex
from mstar.http.speech.audio import check_format, encode_whole
from mstar.types import OutputChunk

if TYPE_CHECKING:
    from mstar.http.submission import Choice
    from mstar.http.text.transcripts import Transcripts

MODALITIES = ("text", "audio")
# OpenAI's chat audio formats -> `speech.audio`'s encoders
FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm"}
REFUSED_FORMATS = {"aac": "no AAC encoder is available"}
STREAMED_FORMAT = "pcm16"
AUDIO_KEYS = frozenset({"voice", "format"})
# the rate of an answer that ended before any audio (OpenAI's pcm16 is 24 kHz); audio says its own
SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class AudioOutput:
    """A chat request's `audio`: the voice to answer in and the format (OpenAI's name) of the answer's audio."""

    voice: str
    format: str

    @property
    def encoding(self) -> str:
        """The format's name among `speech.audio`'s encoders."""
        return FORMATS[self.format]


def read_audio_output(f: Fields, *, stream: bool, logprobs: bool) -> AudioOutput | None:
    """The body's `modalities` and `audio`, checked together; None for a
    text answer. `audio` is read whole first, so a bad field in it is named
    before what it disagrees with."""
    modalities = _read_modalities(f)
    raw = f.obj.get("audio")
    if raw is None:
        if "audio" in modalities:
            raise f.error("audio", "is required when modalities include 'audio': the answer's voice and format")
        return None
    a = Fields(raw, f.name("audio") + ".")
    a.refuse_unknown(AUDIO_KEYS)
    fmt = _read_format(a)
    voice = read_voice(a)
    if voice is None:
        raise a.error("voice", "is required: one of the model's voices (GET /v1/models lists them)")
    if "audio" not in modalities:
        raise f.error("modalities", "must include 'audio' when the body asks for audio")
    if stream and fmt != STREAMED_FORMAT:
        raise a.error("format", f"a streamed answer's audio is '{STREAMED_FORMAT}' (16-bit PCM, 24 kHz mono), "
                                f"got '{fmt}'")
    if logprobs:
        raise f.error("logprobs", "is not given for a spoken answer")
    return AudioOutput(voice, fmt)


def _read_modalities(f: Fields) -> tuple[str, ...]:
    value = f.raw("modalities", ["text"])
    # an answer always has its text (a spoken one as the audio's transcript), as OpenAI's does: never audio alone
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value) \
            or any(m not in MODALITIES for m in value) or len(set(value)) < len(value) or "text" not in value:
        raise f.error("modalities", f"must be [\"text\"] or [\"text\", \"audio\"], got {value!r}")
    return tuple(value)


def _read_format(a: Fields) -> str:
    fmt = a.string("format")
    if fmt is None:
        raise a.error("format", f"is required: one of {list(FORMATS)}")
    if fmt in REFUSED_FORMATS:
        raise a.error("format", f"'{fmt}' is not supported: {REFUSED_FORMATS[fmt]}; use one of {list(FORMATS)}")
    if fmt not in FORMATS:
        raise a.error("format", f"must be one of {list(FORMATS)}, got '{fmt}'")
    try:
        check_format(FORMATS[fmt])
    except RequestError:  # a codec this server's soundfile lacks
        raise a.error("format", f"'{fmt}' is not available on this server (its soundfile lacks the codec); use "
                                "'wav' or 'pcm16'") from None
    return fmt


class SpokenAnswers:
    """The audio side of one request's choices: each one's audio id, the
    format its whole audio is encoded in, and when the audio expires."""

    def __init__(self, output: AudioOutput, choices: int, created: int, kept: Transcripts) -> None:
        self.output = output
        self.ids = [f"audio_{uuid4_hex()}" for _ in range(choices)]
        self.created = created
        self.kept = kept
        self.expires_at = kept.expires_at(created)

    def _keep(self, choice: Choice) -> None:
        """A finished choice's transcript, for a later turn that names its audio id."""
        self.kept.keep(self.ids[choice.index], choice.text, self.created)

    async def message(self, choice: Choice) -> dict[str, Any]:
        """A finished choice's `message`: its audio encoded whole (on a thread: a codec's work)."""
        rate = choice.sample_rate or SAMPLE_RATE
        data = await asyncio.to_thread(_base64_file, self.output.encoding, rate, bytes(choice.audio or b""))
        self._keep(choice)
        return {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                "audio": {"id": self.ids[choice.index], "data": data, "expires_at": self.expires_at,
                          "transcript": choice.text}}

    def deltas(self, choice: Choice, chunk: OutputChunk) -> list[dict[str, Any]]:
        """The stream's entries for a chunk of a choice: its text and PCM16 as
        one audio piece, and once the choice is finished, the expiry update
        and the finish."""
        audio_id = self.ids[choice.index]
        piece: dict[str, Any] = {}
        if chunk.text:
            piece["transcript"] = chunk.text
        if chunk.audio:
            piece["data"] = base64.b64encode(chunk.audio).decode("ascii")
        out = [_entry(choice, {"audio": {"id": audio_id, **piece}})] if piece else []
        if chunk.finished:
            self._keep(choice)
            out.append(_entry(choice, {"audio": {"id": audio_id, "expires_at": self.expires_at}}))
            out.append(_entry(choice, {}, finished=True))
        return out


def spoken_usage(usage: dict[str, int], choices: Sequence[Choice]) -> dict[str, Any]:
    """`usage` with the completion's tokens told apart: the text's (the
    choices' token ids) and the audio's (the rest the engine counted: the
    tokens the talker sampled)."""
    text = sum(len(c.token_ids) for c in choices)
    return {**usage, "completion_tokens_details": {"text_tokens": text,
                                                   "audio_tokens": usage["completion_tokens"] - text}}


def _entry(choice: Choice, delta: dict[str, Any], finished: bool = False) -> dict[str, Any]:
    return {"index": choice.index, "delta": delta, "logprobs": None, **choice.ending(finished)}


def _base64_file(encoding: str, sample_rate: int, pcm: bytes) -> str:
    return base64.b64encode(encode_whole(encoding, sample_rate, pcm)).decode("ascii")
