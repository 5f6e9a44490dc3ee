"""The OpenAI Realtime API's events (GA names), as the websocket carries them.

Client events come in as JSON objects; `check_event` checks the envelope and
`field_of` each field, raising `ProtocolError` (code, message, param), which
the session sends back as an `error` event: a bad event never drops the
socket. Server events go out as plain dicts built here, so their shapes live
in one place.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from mstar.http.ids import uuid4_hex

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
    return f"{prefix}_{uuid4_hex()[:20]}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(err: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    return event("error", error={"type": err.kind, "code": err.code, "message": err.message, "param": err.param,
                                 "event_id": client_event_id})


# ------------------------------------------------------------- parsing


def parse_event(raw: str | bytes) -> dict[str, Any]:
    """A client event's JSON object, its envelope not checked yet (`check_event`)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"the message is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise ProtocolError("an event must be a JSON object", "invalid_event")
    return obj


def check_event(obj: dict[str, Any]) -> None:
    """The envelope: a string `event_id` if any, and a known `type`."""
    if "event_id" in obj and not isinstance(obj["event_id"], str):
        raise ProtocolError("'event_id' must be a string", "invalid_value", "event_id")
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("the event has no 'type'", "missing_field", "type")
    if not isinstance(kind, str):
        raise ProtocolError("'type' must be a string", "invalid_value", "type")
    if kind not in CLIENT_EVENTS:
        raise ProtocolError(f"unknown event type '{kind}'", "unknown_event_type", "type")


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
