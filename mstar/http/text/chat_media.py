"""A chat body's media parts in, the messages a model reads out: each
`MediaPart` checked against what the model takes, decoded in the media
decoder's processes (all of a body's parts at once), and put back in its
message as `{"type": "audio", "audio": <mono float32 array>}` or
`{"type": "image", "image": <RGB uint8 [H, W, 3] array>}`, the model's
contract for decoded media (`mstar.models.base.Model.input_modalities`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from mstar.config import MediaLimits
from mstar.errors import RequestError
from mstar.http.media import MediaDecoder
from mstar.http.text.chat_messages import ChatMessage, MediaPart, media_parts

AUDIO_RATE = 16000  # the rate of a chat audio part's samples, as models read them
PART_TYPE = {"audio": "input_audio", "image": "image_url"}  # a part's modality -> its type in the request


def refuse_untaken(parts: Sequence[MediaPart], model: str, modalities: Sequence[str]) -> None:
    """A 400 naming the first part's `type` whose modality the model does
    not take; before any decoding, which would be wasted on it."""
    for part in parts:
        if part.kind not in modalities:
            takes = " and ".join(modalities) if len(modalities) > 1 else f"only {modalities[0]}"
            raise RequestError(f"model '{model}' takes {takes}, not {PART_TYPE[part.kind]} parts",
                               field=f"{part.at}.type")


async def decode_parts(decoder: MediaDecoder, parts: Sequence[MediaPart], limits: MediaLimits) -> list[Any]:
    """Every part's array, decoded concurrently, in the order of `parts`. The
    first refusal is raised and the decodes still waiting are cancelled."""
    tasks = [asyncio.ensure_future(_decode(decoder, part, limits)) for part in parts]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def with_media(messages: Sequence[ChatMessage], decoded: Sequence[Any]) -> list[dict[str, Any]]:
    """`messages` with their media parts, in order, replaced by `decoded`
    (what `decode_parts` gave for `media_parts(messages)`)."""
    arrays = iter(decoded)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": p.kind, p.kind: next(arrays)} if isinstance(p, MediaPart) else dict(p)
                       for p in content]
        out.append({**message, "content": content})
    if next(arrays, None) is not None:
        raise ValueError("more decoded media than the messages' media parts")
    return out


async def chat_inputs(decoder: MediaDecoder, limits: MediaLimits, messages: Sequence[ChatMessage], model: str,
                      modalities: Sequence[str], add_generation_prompt: bool,
                      template_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A chat's inputs for the model: its media checked against what `model`
    takes (`modalities`), decoded once, and put back in its messages, with
    the template's switches; and each media part's field in errors, by the
    part's place (the model names a decoded part by its content part, the
    client sent it in the part's payload), from the one listing of parts."""
    parts = media_parts(messages)
    refuse_untaken(parts, model, modalities)
    decoded = await decode_parts(decoder, parts, limits)
    values: dict[str, Any] = {"messages": with_media(messages, decoded), "add_generation_prompt": add_generation_prompt}
    if template_kwargs:
        values["chat_template_kwargs"] = template_kwargs
    return values, {p.at: p.field for p in parts}


async def _decode(decoder: MediaDecoder, part: MediaPart, limits: MediaLimits) -> Any:
    if part.kind == "audio":
        return await decoder.audio(part.payload, part.field, max_seconds=limits.max_audio_seconds, rate=AUDIO_RATE)
    return await decoder.image(part.payload, part.field, max_pixels=limits.max_image_pixels)
