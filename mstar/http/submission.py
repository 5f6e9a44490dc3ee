"""Checked request bodies in, running engine requests out.

A prompt is tokenised with the served model's tokenizer, checked against its
context window, and turned into one `GenerateRequest` per choice; the engine's
streams come back as a `Submission` that merges their chunks in arrival order
and keeps each choice's text, tokens and finish reason for the answer.
Talks to the engine only through its public API; importable without torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from mstar.errors import ModelNotFound, MstarError, RequestError
from mstar.http.text.protocol import SAMPLING_KEYS, Prompt
from mstar.types import GenerateRequest, OutputChunk, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from mstar.engine.engine import Engine, RequestStream


R = TypeVar("R")

SPEAK_WALK = "speak"  # the walk of speech models: text and a voice in, audio out
OFF_LOOP_SIZE = 1 << 16  # request bodies and prompts from this size on are parsed and tokenised on a thread


class GenerationFailed(MstarError):
    """A request the engine accepted but could not finish: a 5xx answer."""

    def __init__(self, message: str, status: int = 500, code: str = "generation_failed") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class ClientGone(MstarError):
    """The client hung up before its answer was ready (nginx's status 499)."""

    status = 499


@dataclass(frozen=True)
class Target:
    """The served model a request resolved to."""

    name: str
    tokenizer: Any
    max_model_len: int
    walks: tuple[str, ...] = ()
    default_walk: str = ""


def resolve_model(engine: Engine, requested: str | None) -> Target:
    """The model a request names (default: the engine's); 404 if not served.
    A model without a tokenizer resolves with `tokenizer` None: routes that
    need one refuse it (`encode_prompt`), the speech route does not."""
    name = requested or engine.model_name
    card = next((c for c in engine.model_cards() if c.name == name), None)
    if card is None:
        raise ModelNotFound(name)
    try:
        tokenizer = engine.tokenizer(name)
    except ModelNotFound:
        raise
    except RequestError:
        tokenizer = None
    return Target(name=name, tokenizer=tokenizer, max_model_len=card.max_model_len, walks=tuple(card.walks),
                  default_walk=card.default_walk)


async def off_loop(size: int, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)`, run on a thread when its input is `size` >= `OFF_LOOP_SIZE`
    (characters, bytes or ids): parsing and tokenising a long prompt would
    stall every other client of the event loop meanwhile."""
    if size < OFF_LOOP_SIZE:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def check_length(target: Target, chars: int, field_name: str) -> None:
    """Refuse a text that cannot fit the context before tokenising it: it has
    at least `chars / max_token_bytes` tokens, whatever they turn out to be."""
    per_token = getattr(target.tokenizer, "max_token_bytes", None)
    if per_token and chars > target.max_model_len * per_token:
        raise RequestError(
            f"the prompt is {chars} characters, so at least {chars // per_token} tokens, more than the model's "
            f"context of {target.max_model_len} tokens", field=field_name)


def encode_prompt(target: Target, prompt: Prompt, field_name: str) -> list[int]:
    """Text through the tokenizer (with its special tokens), or ids as given
    once checked against the vocabulary."""
    _need_tokenizer(target)
    if isinstance(prompt, str):
        check_length(target, len(prompt), field_name)
        ids = list(target.tokenizer.encode(prompt, add_special_tokens=True))
    else:
        ids = list(prompt)
        vocab = target.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", field=field_name)
    if not ids:
        raise RequestError("the prompt has no tokens", field=field_name)
    return ids


def encode_chat(target: Target, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Messages through the model's chat template, then the tokenizer; the
    template already placed the special tokens, so encoding adds none."""
    _need_tokenizer(target)
    check_length(target, sum(len(m.get("content") or "") for m in messages), "messages")
    try:
        text = target.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"the chat template refused these messages: {e}", field="messages") from None
    except Exception as e:  # jinja's TemplateError is raised by a template's raise_exception()
        if type(e).__module__.startswith("jinja2"):
            raise RequestError(f"the chat template refused these messages: {e}", field="messages") from None
        raise
    ids = list(target.tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise RequestError("the messages have no tokens", field="messages")
    return ids


def _need_tokenizer(target: Target) -> None:
    if target.tokenizer is None:
        raise RequestError(f"model '{target.name}' has no tokenizer", field="model")


def fit_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                   prompt_field: str, tokens_field: str) -> int:
    """`requested` if the prompt plus it fit the context; None means all the room left."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"the prompt is {prompt_len} tokens but the model's context is {max_model_len} tokens, "
            "leaving no room to generate", field=prompt_field)
    if requested is None:
        return room
    if requested > room:
        raise RequestError(
            f"{requested} tokens plus the {prompt_len}-token prompt exceed the model's context of "
            f"{max_model_len} tokens; at most {room} can be generated here", field=tokens_field)
    return requested


@dataclass
class Choice:
    """What one engine request has produced so far."""

    index: int
    prompt_index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0       # as the engine counts it (it grows as input streams in)
    finish_reason: str | None = None
    error: str | None = None
    audio: bytearray | None = None   # PCM16 so far, if `keep_audio` (streams send it on instead)
    sample_rate: int | None = None
    keep_audio: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if the request asked

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def record(self, chunk: OutputChunk) -> None:
        if chunk.text:
            self.texts.append(chunk.text)
        if chunk.audio is not None:
            self.sample_rate = chunk.sample_rate or self.sample_rate
            if self.keep_audio:
                if self.audio is None:
                    self.audio = bytearray()
                self.audio += chunk.audio
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        self.num_output_tokens = max(chunk.num_output_tokens, len(self.token_ids))
        self.num_prompt_tokens = max(self.num_prompt_tokens, chunk.num_prompt_tokens)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"
            self.error = chunk.error


def failure_of(choice: Choice) -> GenerationFailed | None:
    """Why a finished choice has no answer to give, if it has none."""
    if choice.finish_reason == "error":
        return GenerationFailed(f"generation failed: {choice.error or 'unknown error'}")
    if choice.finish_reason == "timeout":
        return GenerationFailed(choice.error or "the request timed out", status=504, code="timeout")
    if choice.finish_reason == "abort":
        return GenerationFailed("the request was aborted (the server may be shutting down)",
                                status=503, code="aborted")
    return None


@dataclass
class Submission:
    """The engine requests one HTTP request started; `streams[i]` is choice i.

    Always `aclose()` it (in a `finally`): that aborts whatever has not
    finished, which is how a client that went away frees its KV pages.
    """

    streams: list[RequestStream]
    choices: list[Choice]
    prompt_lengths: list[int]

    def usage(self) -> dict[str, int]:
        # A prompt counts once however many samples were drawn from it.
        # the engine's count wins when it grew (input streamed in after the start)
        prompt = sum(max([n, *(c.num_prompt_tokens for c in self.choices if c.prompt_index == p)])
                     for p, n in enumerate(self.prompt_lengths))
        completion = sum(c.num_output_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def chunks(self, gone: Callable[[], bool] | None = None) -> AsyncIterator[tuple[Choice, OutputChunk]]:
        """Every choice's chunks in arrival order, each recorded on its choice
        before it is yielded. Stops early (the caller aborts) if `gone()`."""
        if len(self.streams) == 1:
            async for chunk in self.streams[0]:
                self.choices[0].record(chunk)
                yield self.choices[0], chunk
                if gone is not None and gone():
                    return
            return
        queue: asyncio.Queue[tuple[int, OutputChunk | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((i, chunk))
            except Exception as e:  # surfaced to the consumer, not lost in the task
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        open_streams = len(tasks)
        try:
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.choices[i].record(item)
                yield self.choices[i], item
                if gone is not None and gone():
                    return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_to_end(self, gone: Callable[[], bool] | None = None) -> list[Choice]:
        """Drain every stream; raise `GenerationFailed` if a choice failed,
        `ClientGone` if `gone()` turned true first."""
        async for _ in self.chunks(gone):
            pass
        if any(c.finish_reason is None for c in self.choices):
            raise ClientGone()
        for choice in self.choices:
            failure = failure_of(choice)
            if failure is not None:
                raise failure
        return self.choices

    async def aclose(self) -> None:
        for stream in self.streams:
            await stream.aclose()


def submit(engine: Engine, base_id: str, target: Target, prompts: Sequence[list[int]],
           sampling: SamplingParams, max_tokens: Sequence[int], n: int = 1, walk: str | None = None) -> Submission:
    """One engine request per (prompt, sample), choice index prompt * n + sample.
    Samples of one prompt get distinct seeds (seed, seed + 1, ...) so they differ
    yet stay reproducible. If any submit is refused, the ones before are aborted."""
    streams: list[RequestStream] = []
    choices: list[Choice] = []
    try:
        for p, ids in enumerate(prompts):
            for j in range(n):
                seed = None if sampling.seed is None else (sampling.seed + j) % 2**63
                params = dataclasses.replace(sampling, max_tokens=max_tokens[p], seed=seed)
                index = len(streams)
                request = GenerateRequest(request_id=f"{base_id}-{index}", model=target.name,
                                          inputs={"prompt_ids": list(ids)}, sampling=params, walk=walk)
                streams.append(engine.submit(request))
                choices.append(Choice(index=index, prompt_index=p))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    lengths = [len(ids) for ids in prompts]
    for p in range(len(prompts)):
        # The engine's own count is the truth if it differs from ours.
        counted = getattr(streams[p * n], "num_prompt_tokens", 0)
        if counted:
            lengths[p] = counted
    return Submission(streams=streams, choices=choices, prompt_lengths=lengths)


def model_defaults(engine: Engine) -> SamplingParams:
    """The served model's default sampling (speech models declare theirs)."""
    cards = engine.model_cards()
    return cards[0].default_sampling if cards else SamplingParams()


def submit_inputs(engine: Engine, request_id: str, target: Target, inputs: dict[str, Any], walk: str,
                  sampling: SamplingParams, *, prompt_field: str, tokens_field: str | None,
                  sampling_prefix: str = "", keep_audio: bool = False, more_input: bool = False) -> Submission:
    """One engine request from a walk's raw inputs (the model builds its own
    prompt, e.g. text and a voice for speech). The prompt length is known only
    once the engine prepared it, so the context is checked after submitting:
    a request that does not fit is aborted and refused, naming `tokens_field`
    (the client's max_tokens) or, when the client gave none, `prompt_field`.
    The engine checks `sampling`'s ranges; a field it refuses is named
    `sampling_prefix` + its name, as the client spelled it."""
    # The model names fields as the speech route does; this route's names may differ.
    renamed = {**{name: sampling_prefix + name for name in SAMPLING_KEYS},
               "max_tokens": tokens_field or prompt_field, "input": prompt_field}
    try:
        stream = engine.submit(GenerateRequest(request_id=request_id, model=target.name, inputs=inputs,
                                               sampling=sampling, walk=walk, more_input=more_input))
    except RequestError as e:
        if e.field not in renamed or renamed[e.field] == e.field:
            raise
        raise RequestError(e.message, field=renamed[e.field], status=e.status, code=e.code) from None
    prompt_len = getattr(stream, "num_prompt_tokens", 0)
    try:
        fit_max_tokens(sampling.max_tokens, prompt_len, target.max_model_len, prompt_field,
                       tokens_field or prompt_field)
    except RequestError:
        engine.abort(stream.request_id)
        raise
    return Submission(streams=[stream], choices=[Choice(index=0, prompt_index=0, keep_audio=keep_audio)],
                      prompt_lengths=[prompt_len])
