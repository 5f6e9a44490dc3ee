"""Checked request bodies in, running engine requests out.

Each prompt of a request becomes a `GenerateRequest` of raw inputs (text,
token ids or chat messages), prepared once by the engine's model (which
tokenises and checks it against the context, off the event loop when long),
then started once per choice; the model's field names in its errors become
the route's. The engine's streams come back as a `Submission` that merges
their chunks in arrival order and keeps each choice's text, tokens and
finish reason for the answer. Talks to the engine only through its public
API; importable without torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from mstar.errors import SHUTTING_DOWN, ModelNotFound, MstarError, RequestError
from mstar.http.fields import is_int
from mstar.http.text.protocol import SAMPLING_KEYS, Prompt
from mstar.types import GenerateRequest, ModelCard, OutputChunk, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from mstar.engine.engine import Engine, Prepared, RequestStream


R = TypeVar("R")

SPEAK_WALK = "speak"  # the realtime session's speech walk (Orpheus's); the other routes read `Target.tts_walk`
OFF_LOOP_SIZE = 1 << 16  # request bodies from this size on are parsed on a thread


class GenerationFailed(MstarError):
    """A request the engine accepted but could not finish: a 5xx answer."""

    def __init__(self, message: str, status: int = 500, code: str = "generation_failed",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.retry_after = retry_after  # seconds, for an answer that asks the client to come back


class ClientGone(MstarError):
    """The client hung up before its answer was ready (nginx's status 499)."""

    status = 499


@dataclass(frozen=True)
class Target:
    """The served model a request resolved to. `tts_walk` and
    `spoken_chat_walk` (None where the model has none) serve
    `/v1/audio/speech` and chat with audio out; `tts_sampling` is what a
    request on `tts_walk` gets for the sampling fields it leaves out."""

    name: str
    tokenizer: Any
    max_model_len: int
    walks: tuple[str, ...] = ()
    default_walk: str = ""
    input_modalities: tuple[str, ...] = ("text",)  # what its chat messages may hold
    tts_walk: str | None = None
    spoken_chat_walk: str | None = None
    tts_sampling: SamplingParams = field(default_factory=SamplingParams)
    early_tts_walk: str | None = None  # `tts_walk` with its first audio sooner (`early_audio`), if it has one
    written_walk: str | None = None    # what text routes run where `default_walk` speaks (`Model.written_walk`)
    spoken_audio_key: str | None = None  # the sampling key of a spoken chat answer's frames (`Model.spoken_audio_key`)
    text_defaults: Mapping[str, float | int] = field(default_factory=dict)  # `ModelCard.text_defaults`

    def text_sampling(self, sampling: SamplingParams, given: frozenset[str]) -> SamplingParams:
        """A text request's `sampling` with the fields it left out (not in
        `given`) taken from the model's generation config, as vLLM does."""
        fill = {k: v for k, v in self.text_defaults.items() if k not in given}
        return sampling.replace(**fill) if fill else sampling

    def speaks(self, walk: str | None) -> bool:
        """Whether `walk` (None: the default) is one of its text-to-speech walks."""
        return (walk or self.default_walk) in (self.tts_walk, self.early_tts_walk)


class Targets:
    """The served models' `Target`s, made once per (card, name, tokenizer):
    a Target is made of those alone, every request resolves one, and a card
    (frozen) is the engine's own until it starts again. The app owns one
    (`keys.TARGETS`), beside its engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._kept: dict[str, tuple[ModelCard, Any, Target]] = {}  # by the name requested

    def resolve(self, requested: str | None) -> Target:
        """The model a request names (default: the engine's); 404 if not
        served. `tokenizer` (None for a model without one) is for the
        answer's side: token strings of logprobs, whether a chat template
        is there."""
        engine = self._engine
        name = requested or engine.model_name
        card = next((c for c in engine.model_cards() if c.answers_to(name)), None)
        if card is None:
            raise ModelNotFound(name)
        try:
            tokenizer = engine.tokenizer(name)
        except ModelNotFound:
            raise
        except RequestError:
            tokenizer = None
        kept = self._kept.get(name)
        if kept is not None and kept[0] is card and kept[1] is tokenizer:
            return kept[2]
        # a request that gives no max_tokens sends None: the model's default budget within the room its prompt
        # leaves (`fit_context`), so a default larger than a short context shortens the answer, not refuses it
        tts = card.tts_sampling.replace(max_tokens=None)
        # answers name the model as the request did, by whichever of its served names (vLLM's)
        target = Target(name=name, tokenizer=tokenizer, max_model_len=card.max_model_len, walks=tuple(card.walks),
                        default_walk=card.default_walk, input_modalities=tuple(card.input_modalities),
                        tts_walk=card.tts_walk, spoken_chat_walk=card.spoken_chat_walk, tts_sampling=tts,
                        early_tts_walk=card.early_tts_walk, written_walk=card.written_walk,
                        spoken_audio_key=card.spoken_audio_key, text_defaults=card.text_defaults)
        self._kept[name] = (card, tokenizer, target)  # a name per model and alias: a handful
        return target


async def off_loop(size: int, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)`, run on a thread when its input is `size` >= `OFF_LOOP_SIZE`
    bytes: parsing a long body would stall every other client of the event
    loop meanwhile (its prompt is tokenised off the loop by `Engine.prepare`)."""
    if size < OFF_LOOP_SIZE:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class Inputs:
    """One prompt's raw inputs for the model (`{"prompt": text}`,
    `{"prompt_ids": ids}`, `{"messages": [...]}`, `{"text", "voice"}`), and
    the route's names for the fields the model and engine name in their
    errors (`prompt` -> `prompt[1]`, `max_tokens` -> `sampling_params.max_tokens`)."""

    values: dict[str, Any]
    names: Mapping[str, str] = field(default_factory=dict)


def prompt_inputs(prompt: Prompt) -> dict[str, Any]:
    """A text or token-id prompt as a language model's inputs."""
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": list(prompt)}


def sampling_names(prefix: str) -> dict[str, str]:
    """Each sampling field under the route's `prefix` (`sampling_params.`)."""
    return {name: prefix + name for name in SAMPLING_KEYS}


@functools.lru_cache(maxsize=64)  # a route asks for one of a few, for every request
def spoken_names(prompt_field: str, tokens_field: str | None, sampling_prefix: str = "") -> Mapping[str, str]:
    """The route's names for a model that builds its own prompt (text and a
    voice): its sampling fields under `sampling_prefix`, its `input` as
    `prompt_field`, and `max_tokens` as `tokens_field`, or, when the client
    gave none (the model's default did not fit), as `prompt_field`. Read
    only: every request with these fields shares it."""
    return MappingProxyType({**sampling_names(sampling_prefix), "max_tokens": tokens_field or prompt_field,
                             "input": prompt_field})


def renamed(error: RequestError, names: Mapping[str, str]) -> RequestError:
    """`error` naming its field as the route's client knows it."""
    name = names.get(error.field) if error.field is not None else None
    if name is None or name == error.field:
        return error
    return RequestError(error.message, field=name, status=error.status, code=error.code,
                        retry_after=error.retry_after)


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
    stop_reason: int | str | None = None  # what stopped it (`OutputChunk.stop_reason`)
    error: str | None = None
    audio: bytearray | None = None   # PCM16 so far, if `keep_audio` (streams send it on instead)
    sample_rate: int | None = None
    keep_audio: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if the request asked

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def ending(self, finished: bool = True) -> dict[str, Any]:
        """Its `finish_reason` and vLLM's `stop_reason` (the stop string or
        stop id that ended it, null otherwise) as a choice object carries
        them: both null before it ends."""
        if not finished:
            return {"finish_reason": None, "stop_reason": None}
        return {"finish_reason": self.finish_reason, "stop_reason": self.stop_reason}

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
            self.stop_reason = chunk.stop_reason
            self.error = chunk.error


# what a request the server stopped (its drain at shutdown) tells its client, over HTTP and the realtime socket
ABORTED_MESSAGE = "the request was aborted (the server may be shutting down)"


def failure_of(choice: Choice) -> GenerationFailed | None:
    """Why a finished choice has no answer to give, if it has none."""
    if choice.finish_reason == "error":
        return GenerationFailed(f"generation failed: {choice.error or 'unknown error'}")
    if choice.finish_reason == "timeout":
        return GenerationFailed(choice.error or "the request timed out", status=504, code="timeout")
    if choice.finish_reason == "abort" and choice.error == SHUTTING_DOWN:  # refused at shutdown before it began
        return GenerationFailed(f"{SHUTTING_DOWN}; the request had not started", status=503, code="unavailable",
                                retry_after=5)
    if choice.finish_reason == "abort":
        # cut while it ran, at a shutdown: its client may send it again (elsewhere, or here after a restart)
        return GenerationFailed(ABORTED_MESSAGE, status=503, code="aborted", retry_after=5)
    return None


Chunks = AsyncIterator[tuple[Choice, OutputChunk]]


async def first_chunk(chunks: Chunks) -> tuple[Choice, OutputChunk] | None:
    """A streamed answer's first chunk, taken before its headers go out: a
    request that ended without output (refused at shutdown before it ran,
    timed out in the queue, failed) raises its failure, so it is answered
    with its own status (503 and Retry-After, 504, ...) as a whole answer
    is, and a proxy in front may send it on to another server."""
    first = await anext(chunks, None)
    if first is not None and first[1].finished:
        failure = failure_of(first[0])
        if failure is not None:
            raise failure
    return first


async def after(first: tuple[Choice, OutputChunk] | None, chunks: Chunks) -> Chunks:
    """`first` (taken by `first_chunk`), then the rest of `chunks`. It holds
    nothing of its own: the caller closes `chunks` (`aclosing`), and a loop
    left early leaves this to the event loop's finalizer."""
    if first is not None:
        yield first
    async for item in chunks:
        yield item


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


async def submit(engine: Engine, base_id: str, model: str, prompts: Sequence[Inputs], sampling: SamplingParams,
                 *, n: int = 1, walk: str | None = None, sampling_by: Mapping[str, dict[str, Any]] | None = None,
                 more_input: bool = False, keep_audio: bool = False, priority: int = 0) -> Submission:
    """One engine request per (prompt, sample), choice index prompt * n + sample,
    request id `base_id-index`. Every prompt is prepared first, once
    (`Engine.prepare`: tokenised by the model, off the event loop when
    long), so a bad one refuses the request before any choice starts. Samples
    of one prompt get distinct seeds (seed, seed + 1, ...) so they differ yet
    stay reproducible; the engine resolves each sample's sampling again from
    the prompt's preparation. If any start is refused, those before are aborted."""
    requests: list[GenerateRequest] = []
    prepared: list[Prepared] = []
    for p, prompt in enumerate(prompts):
        request = GenerateRequest(request_id=f"{base_id}-{p * n}", model=model, inputs=prompt.values,
                                  sampling=sampling, walk=walk, more_input=more_input,
                                  sampling_by=dict(sampling_by or {}), priority=priority)
        try:
            prepared.append(await engine.prepare(request))
        except RequestError as e:
            raise renamed(e, prompt.names) from None
        requests.append(request)
    streams: list[RequestStream] = []
    try:
        for p, (first, ready) in enumerate(zip(requests, prepared)):
            for j in range(n):
                request = first if j == 0 else dataclasses.replace(
                    first, request_id=f"{base_id}-{p * n + j}",
                    sampling=dataclasses.replace(sampling, seed=_sample_seed(sampling.seed, j)),
                    sampling_by=_sample_seeds(first.sampling_by, j))
                try:
                    streams.append(engine.submit(request, ready))
                except RequestError as e:
                    raise renamed(e, prompts[p].names) from None
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    choices = [Choice(index=i, prompt_index=i // n, keep_audio=keep_audio) for i in range(len(streams))]
    # the engine counts each prompt's tokens once it is prepared
    return Submission(streams=streams, choices=choices,
                      prompt_lengths=[streams[p * n].num_prompt_tokens for p in range(len(prompts))])


def _sample_seed(seed: int | None, j: int) -> int | None:
    """Sample j's seed: the request's moved by j (vLLM's), so that its samples differ and each is reproducible."""
    return None if seed is None else (seed + j) % 2**63


def _sample_seeds(sampling_by: dict[str, dict[str, Any]], j: int) -> dict[str, dict[str, Any]]:
    """`sampling_by` for sample j: a seed it sets moves by j as the body's own does, else every sample
    would draw the same tokens. One the model refuses (not an int64) refused the first sample already."""
    return {key: {**fields, "seed": _sample_seed(fields["seed"], j)}
            if is_int(fields.get("seed")) and 0 <= fields["seed"] < 2**63 else fields
            for key, fields in sampling_by.items()}


def model_defaults(engine: Engine) -> SamplingParams:
    """The served model's default sampling (speech models declare theirs)."""
    cards = engine.model_cards()
    return cards[0].default_sampling if cards else SamplingParams()
