"""A hearing model's conversation: realtime items in, the chat messages of
one spoken-chat request out.

Each response of a model that hears and speaks (Qwen3-Omni) is one request
on its `spoken_chat_walk` over the whole conversation so far: the session's
instructions as a system message, user items as text and audio parts (their
audio at the encoder's 16 kHz, kept by item id since the client's items
carry none back), assistant items as their transcripts. Building it here
keeps the swap to one running request that takes more audio local to this
file and the session's `_plan`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mstar.http.realtime.protocol import ProtocolError, decode_audio, field_of

TEXT_PARTS = ("input_text", "text", "output_text")
AUDIO_PARTS = ("input_audio", "output_audio", "audio")


def heard_parts(item: dict[str, Any], where: str) -> list[str | bytes]:
    """A message item's content as text pieces and PCM16 clips (an
    `input_audio` part's base64 `audio`); a part with neither is refused."""
    parts = field_of(item, "content", list, where)
    out: list[str | bytes] = []
    for i, part in enumerate(parts):
        path = f"{where}.content[{i}]"
        if not isinstance(part, dict):
            raise ProtocolError(f"'{path}' must be an object", "invalid_value", path)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            out.append(field_of(part, "text", str, path))
        elif kind in AUDIO_PARTS:
            data = field_of(part, "audio", str, path, required=False)
            transcript = field_of(part, "transcript", str, path, required=False)
            if data is not None and kind == "input_audio":
                out.append(decode_audio(data, f"{path}.audio"))
            elif transcript:
                out.append(transcript)
            elif kind == "input_audio":
                raise ProtocolError("an input_audio part needs its 'audio' (base64 PCM16)", "missing_field",
                                    f"{path}.audio")
        else:
            raise ProtocolError(f"content part type {kind!r} is not supported", "unsupported_content", path)
    return out


def chat_messages(items: list[dict[str, Any]], audio: dict[str, list[np.ndarray]],
                  instructions: str) -> list[dict[str, Any]]:
    """The spoken-chat request's messages for `items` (message items in
    order); `audio` holds each user item's clips at 16 kHz by item id."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item.get("type") != "message":
            continue
        role = item.get("role")
        texts = [_text_of(part) for part in item.get("content") or ()]
        text = "".join(t for t in texts if t)
        if role != "user":
            if text:
                messages.append({"role": role, "content": text})
            continue
        parts: list[dict[str, Any]] = [{"type": "audio", "audio": clip} for clip in audio.get(item["id"], ())]
        if text:
            parts.append({"type": "text", "text": text})
        if parts:
            messages.append({"role": "user", "content": parts})
    return messages


def _text_of(part: Any) -> str:
    if not isinstance(part, dict):
        return ""
    if part.get("type") in TEXT_PARTS:
        return part.get("text") or ""
    return part.get("transcript") or ""
