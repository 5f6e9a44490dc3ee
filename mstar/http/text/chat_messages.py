"""Chat messages in OpenAI's shape in, `{"role", "content"}` dicts out.

A message whose content is a string, or whose parts are all text, gets its
text joined into one string, as the Hugging Face chat templates of text
models want it. A message with audio (`input_audio`) or image (`image_url`)
parts keeps its parts in order, so that a part's index is the one the
client sent (the model names `messages[i].content[j]` in its errors): text
parts as `{"type": "text", "text"}`, media parts as `MediaPart`s whose
payload is not decoded here; `chat_media.py` decodes them off the event
loop and puts the arrays in their place. An `input_text` part is text, as
is an assistant message's `refusal` part (replayed history, as vLLM reads
it). Tool calls and unknown roles or
part types are refused naming the field, and so is an assistant message's
`audio` (an earlier spoken answer by id: none is kept). Importable without
torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mstar.http.fields import Fields, type_name
from mstar.http.media import audio_format

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
PART_TYPES = ("text", "input_text", "refusal", "input_audio", "image_url")
# parts read as text: the Responses API's `input_text` as vLLM reads it, and an earlier answer's `refusal`
TEXT_KEYS = {"text": "text", "input_text": "text", "refusal": "refusal"}
IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; accepted and ignored: a model sees every image whole
# a media part's own object is refused with a key it does not know (a typo, such as `detial`); a message or a
# part with extra keys passes, as vLLM's do: clients carry keys of other APIs (`annotations`, `cache_control`)
IMAGE_URL_KEYS = frozenset({"url", "detail"})
INPUT_AUDIO_KEYS = frozenset({"data", "format"})

# a message's content once read: a string, or its parts (text dicts and MediaParts)
ChatMessage = dict[str, Any]
# an assistant message naming an earlier spoken answer by its audio id holds (id, field) under this key until
# the route puts that answer's transcript in its place (`transcripts.py`)
AUDIO_ID = "audio_id"


@dataclass(frozen=True)
class MediaPart:
    """One audio or image content part of a chat body, as the client sent it.

    `kind`: the modality a model must take for it ("audio" or "image");
    `payload`: base64 audio, or an image's URL (a data URL is the only kind
    served); `format`: the declared audio format, None for an image or an
    audio part that declares none (the decoder reads the container from the
    bytes either way); `field`: the payload's field in errors
    (`messages[1].content[2].input_audio.data`); `at`: the part's own
    (`messages[1].content[2]`)."""

    kind: str
    payload: str
    format: str | None
    field: str
    at: str


def read_messages(f: Fields) -> tuple[ChatMessage, ...]:
    """The body's `messages`, checked; `developer` becomes `system`."""
    value = f.raw("messages")
    if not isinstance(value, list) or not value:
        raise f.error("messages", "must be a non-empty array of messages")
    out = []
    for i, raw in enumerate(value):
        m = Fields(raw, f"messages[{i}].")
        role = m.string("role")
        if role not in CHAT_ROLES:
            raise m.error("role", f"must be one of {list(CHAT_ROLES)}, got {role!r}")
        m.unsupported_if_truthy("tool_calls")
        m.unsupported_if_truthy("function_call")
        content = _read_content(m, role)
        # Hugging Face chat templates know "system", not OpenAI's newer "developer".
        message = {"role": "system" if role == "developer" else role, "content": content}
        if m.has("audio"):  # OpenAI's reference to an earlier spoken answer, by its id
            if role != "assistant":
                raise m.error("audio", "only an assistant message names an earlier spoken answer")
            audio = Fields(m.mapping("audio"), m.name("audio") + ".")
            audio.refuse_unknown(frozenset({"id"}))
            audio_id = audio.string("id")
            if not audio_id:
                raise audio.error("id", "is required: the id of an earlier spoken answer")
            message[AUDIO_ID] = (audio_id, audio.name("id"))
        out.append(message)
    return tuple(out)


def media_parts(messages: Sequence[ChatMessage]) -> list[MediaPart]:
    """Every media part of `messages`, in the order they were sent."""
    return [part for m in messages if isinstance(m["content"], list)
            for part in m["content"] if isinstance(part, MediaPart)]


def _read_content(m: Fields, role: str) -> str | list[dict[str, str] | MediaPart]:
    value = m.obj.get("content")
    if value is None:
        if role == "assistant":
            return ""
        raise m.error("content", "is required")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise m.error("content", "must be a string or an array of content parts")
    if not value and role != "assistant":  # OpenAI's too: an array of at least one part (an answer may be empty)
        raise m.error("content", "is an empty array; it needs at least one content part")
    parts = [_read_part(Fields(raw, f"{m.name('content')}[{j}]."), role) for j, raw in enumerate(value)]
    if any(isinstance(p, MediaPart) for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts if isinstance(p, dict))


def _read_part(part: Fields, role: str) -> dict[str, str] | MediaPart:
    kind = part.string("type")
    at = part.prefix.rstrip(".")
    if kind == "refusal" and role != "assistant":
        raise part.error("type", "a refusal part belongs to an assistant message")
    if kind in TEXT_KEYS:
        key = TEXT_KEYS[kind]
        text = part.string(key)
        if text is None:
            raise part.error(key, "is required")
        return {"type": "text", "text": text}
    if kind not in PART_TYPES:
        raise part.error("type", f"content part type {kind!r} is not supported; one of {list(PART_TYPES)} is")
    if kind == "input_audio":
        audio = _inner(part, "input_audio")
        audio.refuse_unknown(INPUT_AUDIO_KEYS)
        declared = audio.raw("format")
        data = _payload(audio, "data")
        if data[:5].lower() == "data:":  # an image_url habit; said plainly, not as the base64 error it would be
            raise audio.error("data", "is a data URL; input_audio.data takes the file's base64 alone (its type "
                                      "goes in input_audio.format)")
        return MediaPart("audio", data,
                         None if declared is None else audio_format(declared, audio.name("format")),
                         audio.name("data"), at)
    url = part.raw("image_url")
    if isinstance(url, str):  # some clients send the URL itself
        return MediaPart("image", _payload(part, "image_url"), None, part.name("image_url"), at)
    image = _inner(part, "image_url")
    image.refuse_unknown(IMAGE_URL_KEYS)
    detail = image.string("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise image.error("detail", f"must be one of {list(IMAGE_DETAILS)}, got {detail!r}")
    return MediaPart("image", _payload(image, "url"), None, image.name("url"), at)


def _inner(part: Fields, key: str) -> Fields:
    """The part's object under `key` (`input_audio`, `image_url`)."""
    if not part.has(key):
        raise part.error(key, "is required")
    return Fields(part.raw(key), part.name(key) + ".")


def _payload(f: Fields, key: str) -> str:
    """A non-empty string; what it holds is the decoder's to check, off the loop."""
    value = f.raw(key)
    if not isinstance(value, str):
        raise f.error(key, f"must be a string, not {type_name(value)}" if value is not None else "is required")
    if not value:
        raise f.error(key, "is empty")
    return value
