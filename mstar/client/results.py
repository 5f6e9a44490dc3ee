"""Server JSON in, typed results out: one dataclass per answer or stream
chunk of the text routes, plus the health report and the model list.

Each keeps the decoded JSON it came from in `raw`, so a field the server adds
later is reachable before this module learns its name.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, obj: Any) -> Usage | None:
        if not isinstance(obj, Mapping):
            return None
        return cls(int(obj.get("prompt_tokens", 0)), int(obj.get("completion_tokens", 0)),
                   int(obj.get("total_tokens", 0)))


@dataclass(frozen=True)
class ChatAudio:
    """A chat answer's speech (`modalities: ["text", "audio"]`): whole, the
    file in the asked `format` and the whole transcript; streamed, each
    chunk's piece of PCM16 and of the transcript (either may be empty), the
    last one carrying `expires_at`. `id` names the answer in a later turn."""

    id: str
    data: bytes
    transcript: str
    expires_at: int | None = None

    @classmethod
    def of(cls, obj: Any) -> ChatAudio | None:
        if not isinstance(obj, Mapping):
            return None
        data, expires = obj.get("data"), obj.get("expires_at")
        return cls(str(obj.get("id", "")), base64.b64decode(data) if data else b"", obj.get("transcript") or "",
                   int(expires) if expires is not None else None)


@dataclass(frozen=True)
class Choice:
    """One choice: the whole text of an answer, or the new text of a chunk
    (for chat, the message's or the delta's content, and its `audio` when
    the answer is spoken too)."""

    index: int
    text: str
    finish_reason: str | None
    role: str | None = None  # chat only: "assistant"
    logprobs: Any = None     # as the server sent them (OpenAI's shape for the route), if asked for
    audio: ChatAudio | None = None

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Choice:
        message = obj.get("message") or obj.get("delta")
        if isinstance(message, Mapping):  # chat
            return cls(int(obj.get("index", 0)), message.get("content") or "", obj.get("finish_reason"),
                       message.get("role"), obj.get("logprobs"), ChatAudio.of(message.get("audio")))
        return cls(int(obj.get("index", 0)), obj.get("text") or "", obj.get("finish_reason"),
                   logprobs=obj.get("logprobs"))


@dataclass(frozen=True)
class Completion:
    """A whole answer of `/v1/completions` or `/v1/chat/completions`; with
    `stream=True`, one chunk of it (the same shape, new text only)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """The first choice's text: what most callers, asking for one, want."""
        return self.choices[0].text if self.choices else ""

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Completion:
        return cls(str(obj.get("id", "")), str(obj.get("object", "")), int(obj.get("created", 0)),
                   str(obj.get("model", "")), [Choice.of(c) for c in obj.get("choices") or ()],
                   Usage.of(obj.get("usage")), obj)


@dataclass(frozen=True)
class Generation:
    """The answer of the native `/generate`; with `stream=True`, one NDJSON
    line of it (new tokens and text; `finished` on the last).

    Speech models add `audio`, PCM16 little-endian mono at `sample_rate`.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    usage: Usage | None
    audio: bytes | None
    sample_rate: int | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, obj: dict[str, Any], *, finished: bool | None = None) -> Generation:
        audio = obj.get("audio")
        rate = obj.get("sample_rate")
        return cls(str(obj.get("request_id", "")), obj.get("text") or "", list(obj.get("token_ids") or ()),
                   bool(obj.get("finished")) if finished is None else finished, obj.get("finish_reason"),
                   Usage.of(obj.get("usage")), base64.b64decode(audio) if audio else None,
                   int(rate) if rate is not None else None, obj)


@dataclass(frozen=True)
class ModelCard:
    """One entry of `/v1/models` (or `/v1/models/{id}`); `voices` are a
    speech model's, empty for others; `input_modalities` what its chat
    messages may hold (`text`, `audio`, `image`)."""

    id: str
    owned_by: str
    created: int
    max_model_len: int | None
    voices: tuple[str, ...]
    raw: dict[str, Any] = field(repr=False, compare=False)
    # a server that does not list them takes text only
    input_modalities: tuple[str, ...] = ("text",)

    @classmethod
    def of(cls, obj: dict[str, Any]) -> ModelCard:
        limit = obj.get("max_model_len")
        inputs = obj.get("input_modalities")
        return cls(str(obj.get("id", "")), str(obj.get("owned_by", "")), int(obj.get("created", 0)),
                   int(limit) if limit is not None else None, tuple(str(v) for v in obj.get("voices") or ()), obj,
                   tuple(str(v) for v in inputs) if isinstance(inputs, list) else ("text",))


@dataclass(frozen=True)
class Health:
    """`/health`: `status` "ok" when every device worker is alive."""

    status: str
    model: str
    requests_running: int
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Health:
        return cls(str(obj.get("status", "")), str(obj.get("model", "")), int(obj.get("requests_running", 0)), obj)
