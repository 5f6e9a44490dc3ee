"""The OpenAI Realtime API's events (GA names), as the websocket carries them.

Client events come in as JSON objects; `parse_event` checks the envelope and
`field_of` each field, raising `ProtocolError` (code, message, param), which
the session sends back as an `error` event: a bad event never drops the
socket. Server events go out as plain dicts built here, so their shapes live
in one place. `SessionConfig` is the session object of `session.created` /
`session.updated`, with what `session.update` may change.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

# what mstar speaks on the websocket: 24 kHz mono PCM16 both ways
AUDIO_FORMAT = {"type": "audio/pcm", "rate": 24_000}
MODALITIES = ("text", "audio")
# a speech request's input stays open this long after the model caught up,
# so text sent while the audio still plays joins the same request
DEFAULT_INPUT_LINGER_MS = 1000
MAX_INPUT_LINGER_MS = 60_000

CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.truncate", "conversation.item.delete",
    "conversation.item.retrieve", "response.create", "response.cancel",
})


class ProtocolError(Exception):
    """A client event the session refuses; becomes an `error` event."""

    def __init__(self, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind


def new_id(prefix: str) -> str:
    """Ids in OpenAI's style (`event_...`, `item_...`, `resp_...`)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    return event("error", error={"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                                 "event_id": client_event_id})


# ------------------------------------------------------------- parsing


def parse_event(raw: str | bytes) -> dict[str, Any]:
    """A client event's JSON object, with a known `type`."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"the message is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise ProtocolError("an event must be a JSON object", "invalid_event")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("the event has no 'type'", "missing_field", "type")
    if kind not in CLIENT_EVENTS:
        raise ProtocolError(f"unknown event type '{kind}'", "unknown_event_type", "type")
    return obj


def field_of(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str,
             required: bool = True) -> Any:
    """`obj[name]`, checked to be of `kind`; `where` prefixes the param path."""
    value = obj.get(name)
    param = f"{where}.{name}" if where else name
    if value is None:
        if required:
            raise ProtocolError(f"'{param}' is required", "missing_field", param)
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(f"'{param}' must be of type {names}", "invalid_value", param)
    return value


def decode_audio(data: str, param: str) -> bytes:
    """Base64 PCM16 of whole samples."""
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("the audio is not valid base64", "invalid_base64", param) from None
    if len(pcm) % 2:
        raise ProtocolError("PCM16 audio must hold whole 2-byte samples", "invalid_audio", param)
    return pcm


def item_text(item: dict[str, Any], where: str) -> str:
    """The text of a message item's content parts (input_text, text,
    output_text); refuses parts mstar cannot read."""
    parts = field_of(item, "content", list, where)
    texts = []
    for i, part in enumerate(parts):
        path = f"{where}.content[{i}]"
        if not isinstance(part, dict):
            raise ProtocolError(f"'{path}' must be an object", "invalid_value", path)
        kind = part.get("type")
        if kind in ("input_text", "text", "output_text"):
            texts.append(field_of(part, "text", str, path))
        elif kind in ("input_audio", "output_audio", "audio"):
            transcript = field_of(part, "transcript", str, path, required=False)
            if transcript:
                texts.append(transcript)
            elif kind == "input_audio":
                raise ProtocolError("this model takes no audio input", "audio_input_not_supported", path)
        else:
            raise ProtocolError(f"content part type {kind!r} is not supported", "unsupported_content", path)
    return "".join(texts)


def output_limit(value: Any, param: str, most: int) -> int | None:
    """A `max_output_tokens` value: a positive integer up to `most` (the
    model's context: more could never be written), or "inf" (None)."""
    if isinstance(value, str) and value == "inf":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise ProtocolError(f"'{param}' must be an integer in [1, {most}] or 'inf'", "invalid_value", param)
    return value


def check_format(fmt: Any, param: str) -> None:
    """An audio `format`, if given, must be what mstar speaks."""
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != AUDIO_FORMAT["type"]
                            or fmt.get("rate", AUDIO_FORMAT["rate"]) != AUDIO_FORMAT["rate"]):
        raise ProtocolError("only 24 kHz PCM16 audio ('audio/pcm', rate 24000) is supported",
                            "unsupported_audio_format", param)


# -------------------------------------------------------------- session


@dataclass
class SessionConfig:
    """The session object; `speaks`: the model has audio out (then audio is
    the only output modality), else text."""

    session_id: str
    model: str
    speaks: bool
    voices: tuple[str, ...]
    voice: str | None
    max_model_len: int
    instructions: str = ""
    max_output_tokens: int | None = None
    input_linger_ms: int = DEFAULT_INPUT_LINGER_MS
    seed: int | None = None  # responses draw reproducibly (each response from this seed)

    @property
    def modalities(self) -> list[str]:
        return ["audio"] if self.speaks else ["text"]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "realtime", "object": "realtime.session", "id": self.session_id, "model": self.model,
            "output_modalities": self.modalities, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "tools": [], "tool_choice": "none",
            "audio": {
                "input": {"format": AUDIO_FORMAT, "turn_detection": None, "transcription": None},
                "output": {"format": AUDIO_FORMAT, "voice": self.voice, "speed": 1.0},
            },
            # no served model takes audio input yet; the demo's microphone follows this flag
            "mstar": {"input_linger_ms": self.input_linger_ms, "seed": self.seed, "voices": list(self.voices),
                      "audio_input": False},
        }
        return out

    def update(self, session: dict[str, Any]) -> None:
        """Apply `session.update`'s session object; refuses what mstar cannot
        honour (server VAD, other audio formats, a text-only speech model)
        instead of ignoring it."""
        kind = session.get("type", "realtime")
        if kind != "realtime":
            raise ProtocolError(f"session type {kind!r} is not supported (only 'realtime')", "invalid_value",
                                "session.type")
        model = field_of(session, "model", str, "session", required=False)
        if model is not None and model != self.model:
            raise ProtocolError(f"this session serves '{self.model}'; connect with ?model= to use another",
                                "invalid_value", "session.model")
        instructions = field_of(session, "instructions", str, "session", required=False)
        self.check_modalities(session, "session")
        raw_limit = session.get("max_output_tokens")
        limit = (output_limit(raw_limit, "session.max_output_tokens", self.max_model_len)
                 if raw_limit is not None else None)
        audio = field_of(session, "audio", dict, "session", required=False) or {}
        voice = self._audio(audio)
        linger, seed = self._extension(session)
        # all checked: apply together, so a refused update changes nothing
        if instructions is not None:
            self.instructions = instructions
        if raw_limit is not None:
            self.max_output_tokens = limit
        if voice is not None:
            self.voice = voice
        if linger is not None:
            self.input_linger_ms = linger
        if seed is not None:
            self.seed = seed

    def _audio(self, audio: dict[str, Any]) -> str | None:
        inp = field_of(audio, "input", dict, "session.audio", required=False) or {}
        out = field_of(audio, "output", dict, "session.audio", required=False) or {}
        for where, part in (("input", inp), ("output", out)):
            check_format(part.get("format"), f"session.audio.{where}.format")
        if inp.get("turn_detection") is not None:
            raise ProtocolError("server-side turn detection is not supported; set it to null and commit the "
                                "input audio buffer yourself", "unsupported_turn_detection",
                                "session.audio.input.turn_detection")
        voice = field_of(out, "voice", str, "session.audio.output", required=False)
        if voice is not None:
            voice = self.check_voice(voice, "session.audio.output.voice")
        return voice

    def check_voice(self, voice: str, param: str) -> str:
        name = voice.strip().lower()
        if name not in self.voices:
            have = ", ".join(self.voices) or "none"
            raise ProtocolError(f"unknown voice {voice!r}; this model has {have}", "invalid_value", param)
        return name

    def check_modalities(self, obj: dict[str, Any], where: str) -> None:
        """`output_modalities`, if given, must be what the model answers in."""
        modalities = field_of(obj, "output_modalities", list, where, required=False)
        if modalities is None:
            return
        for i, modality in enumerate(modalities):
            if not isinstance(modality, str) or modality not in MODALITIES:
                param = f"{where}.output_modalities[{i}]"
                raise ProtocolError(f"'{param}' must be one of {', '.join(MODALITIES)}", "invalid_value", param)
        if sorted(set(modalities)) != self.modalities:
            raise ProtocolError(f"model '{self.model}' answers in {self.modalities}, not {modalities}",
                                "invalid_value", f"{where}.output_modalities")

    @staticmethod
    def _extension(session: dict[str, Any]) -> tuple[int | None, int | None]:
        """mstar's own fields under `session.mstar`: (input_linger_ms, seed)."""
        ext = field_of(session, "mstar", dict, "session", required=False) or {}
        linger = field_of(ext, "input_linger_ms", int, "session.mstar", required=False)
        if linger is not None and not 0 <= linger <= MAX_INPUT_LINGER_MS:
            raise ProtocolError(f"must be in [0, {MAX_INPUT_LINGER_MS}]", "invalid_value",
                                "session.mstar.input_linger_ms")
        seed = field_of(ext, "seed", int, "session.mstar", required=False)
        if seed is not None and not 0 <= seed < 2**63:
            raise ProtocolError("must be in [0, 2**63)", "invalid_value", "session.mstar.seed")
        return linger, seed
