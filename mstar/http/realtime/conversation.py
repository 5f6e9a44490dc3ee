"""A conversation's messages: realtime items in, the chat messages of one
request out (a hearing model's spoken chat; a text model's chat), cut to
the model's context where the session's truncation is "auto".

Each response of a model that hears and speaks (Qwen3-Omni) is one request
on its `spoken_chat_walk` over the whole conversation so far: the session's
instructions as a system message, user items as text and audio parts (their
audio at the encoder's 16 kHz, kept by item id since the client's items
carry none back), assistant items as their transcripts. Building it here
keeps the swap to one running request that takes more audio local to this
file and `planner.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np

from mstar.errors import CONTEXT_EXCEEDED, RequestError
from mstar.http.realtime.input_audio import INPUT_RATE, MIN_COMMIT_MS
from mstar.http.realtime.protocol import ProtocolError, decode_audio, field_of
from mstar.types import GenerateRequest

if TYPE_CHECKING:
    from mstar.engine.engine import Prepared

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
                pcm = decode_audio(data, f"{path}.audio")
                if len(pcm) < MIN_COMMIT_MS * INPUT_RATE // 1000 * 2:  # as a committed turn: refused here, not at
                    raise ProtocolError(  # every later response that would read it
                        f"holds {len(pcm) // 2 * 1000 // INPUT_RATE} ms of audio; a user's audio needs at least "
                        f"{MIN_COMMIT_MS} ms (24 kHz PCM16)", "audio_too_short", f"{path}.audio")
                out.append(pcm)
            elif transcript:
                out.append(transcript)
            elif kind == "input_audio":
                raise ProtocolError("an input_audio part needs its 'audio' (base64 PCM16)", "missing_field",
                                    f"{path}.audio")
        else:
            raise ProtocolError(f"content part type {kind!r} is not supported", "unsupported_content", path)
    return out


def cut_transcripts(item: dict[str, Any], share: float) -> None:
    """An assistant item whose audio was heard for `share` of its length:
    each spoken part's transcript cut to as much of its text, back to a
    word's end where it has words (a text without spaces is cut by
    characters)."""
    for part in item.get("content", []):
        text = part.get("transcript") if isinstance(part, dict) else None
        if not text or share >= 1:
            continue
        n = int(len(text) * max(share, 0.0))
        kept = text[:n]
        if n < len(text) and not text[n].isspace() and any(c.isspace() for c in text):
            kept = kept[:max(kept.rfind(" "), kept.rfind("\n")) + 1]  # mid-word: back to the last whole one
        part["transcript"] = kept.rstrip()


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


async def fitted(messages: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], GenerateRequest],
                 prepare: Callable[[GenerateRequest], Awaitable[Prepared]], truncate: bool, max_model_len: int,
                 answer: int = 1) -> tuple[GenerateRequest, Prepared, int]:
    """The request `make` builds over `messages`, prepared, and how many of
    the oldest messages it leaves out. With `truncate` (OpenAI's "auto"
    truncation), a conversation that leaves less than `answer` tokens of
    the context for the answer drops its oldest messages, the system
    message kept: the fewest that leave that room (found by bisection, each
    try a whole prepare), else the fewest that fit at all. Without, or if
    not even the newest message fits, the context's error stands: with
    `truncate`, the error of the newest message alone (the system message
    kept), which no truncation could shorten."""
    tries: dict[int, tuple[GenerateRequest, Prepared, int] | None] = {}  # k oldest left out -> its prepare
    head = 1 if messages and messages[0].get("role") == "system" else 0
    too_long: dict[int, RequestError] = {}  # k oldest left out -> the context's error

    def roomy(prepared: Prepared) -> bool:
        return prepared.num_prompt_tokens + answer <= max_model_len

    async def attempt(k: int) -> tuple[GenerateRequest, Prepared, int] | None:
        if k not in tries:
            request = make(messages[:head] + messages[head + k:])
            try:
                tries[k] = request, await prepare(request), k
            except RequestError as e:
                if e.code != CONTEXT_EXCEEDED or not (truncate or k):
                    raise
                too_long[k] = e
                tries[k] = None
        return tries[k]

    async def fewest(good: Callable[[Prepared], bool]) -> tuple[GenerateRequest, Prepared, int] | None:
        """The try with the fewest left out whose prepare is `good` (more left out is never worse)."""
        lo, hi, best = 0, len(messages) - head - 1, None  # the newest message always stays
        while lo <= hi:
            k = (lo + hi) // 2
            tried = await attempt(k)
            if tried is not None and good(tried[1]):
                best, hi = tried, k - 1
            else:
                lo = k + 1
        return best

    whole = await attempt(0)
    if whole is not None and (not truncate or roomy(whole[1])):
        return whole
    best = await fewest(roomy) or await fewest(lambda p: True) or whole
    if best is None:  # not even the newest message fits: its own error (the search tried it last)
        raise too_long[max(too_long)]
    return best
