"""Sampling options: keyword arguments of the client's methods in, fields
of a request body out (top level on the OpenAI routes, under
`sampling_params` on `/generate`), so each method's signature is typed once."""

from __future__ import annotations

from typing import Any, TypedDict


class Sampling(TypedDict, total=False):
    """Sampling fields every generating route takes; what is left out takes
    the server's (or, for speech, the model's) default."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    ignore_eos: bool
    min_tokens: int


class TextSampling(Sampling, total=False):
    """Text routes also stop on strings or token ids, and report log
    probabilities: `completions(logprobs=k)`, `chat(logprobs=True,
    top_logprobs=k)`; each choice then has them in OpenAI's shape."""

    stop: str | list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logprobs: int | bool
    top_logprobs: int


class ChatOptions(TextSampling, total=False):
    """A chat may ask a model that speaks in chat (Qwen3-Omni) for its answer
    in speech too, as OpenAI's chat does: `modalities=["text", "audio"]`,
    `audio={"voice": ..., "format": "wav"}` ("pcm16" when streamed); each
    choice's `audio` then holds it."""

    modalities: list[str]
    audio: dict[str, Any]
