"""Request bodies in, checked request dataclasses out.

Raw JSON bytes of `/v1/completions`, `/v1/chat/completions` and `/generate`
become `CompletionBody`, `ChatBody` and `GenerateBody`; anything malformed,
mistyped, out of range or unsupported raises `RequestError` naming the field.
Nothing here knows the model: prompt lengths, the context window and what
`sampling_by` holds are checked later, by the model as it prepares the
request (see `submission.py`).
Importable without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

import orjson

from mstar.errors import RequestError
from mstar.http.text.chat_audio import AudioOutput, read_audio_output
from mstar.http.text.chat_messages import ChatMessage, read_messages
from mstar.http.fields import Fields, is_int_list, type_name
from mstar.types import MAX_LOGPROBS, SamplingParams

MAX_N = 64                 # samples per prompt
MAX_CHOICES = 256          # prompts x n in one request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# A prompt is text, or token ids that skip the tokenizer.
Prompt = Union[str, tuple[int, ...]]

SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# mstar's: sampling per sampling key of the walk, checked by the model
SAMPLING_BY = "sampling_by"
GENERATE_KEYS = frozenset({"text", "input_ids", "model", "sampling_params", "stream", "voice", "walk", SAMPLING_BY,
                           "priority"})
# Every route answers a field it does not know with a 400 naming it, as OpenAI does. The OpenAI routes know
# each field of OpenAI's own request, whether served or refused with a reason, and mstar's sampling extensions.
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})
SAMPLING_EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens",
                                 "skip_special_tokens", "include_stop_str_in_output", SAMPLING_BY, "priority"})
OPENAI_KEYS = SAMPLING_EXTENSIONS | {
    "model", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "seed", "stop", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format"}
COMPLETION_KEYS = OPENAI_KEYS | {"prompt", "best_of", "echo", "suffix"}
CHAT_KEYS = OPENAI_KEYS | {
    "messages", "max_completion_tokens", "add_generation_prompt", "chat_template_kwargs", "top_logprobs", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities", "audio", "prediction",
    "reasoning_effort", "verbosity", "web_search_options", "metadata", "store", "service_tier", "safety_identifier",
    "prompt_cache_key"}
SERVICE_TIERS = ("auto", "default")  # the tiers that ask for nothing special; one tier serves every request


@dataclass(frozen=True)
class CompletionBody:
    """`/v1/completions`: one choice per (prompt, sample); index = prompt * n + sample.
    `sampling_by`: sampling key -> `SamplingParams` fields (every route's)."""

    model: str | None
    prompts: tuple[Prompt, ...]
    max_tokens: int | None   # None: the model's default budget within the room each prompt leaves, else all of it
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's `continuous_usage_stats`: the totals so far in every chunk
    sampling_by: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    priority: int = 0
    sampling_given: frozenset[str] = frozenset()  # the keys the client set: sampling the model's defaults leave be


@dataclass(frozen=True)
class ChatBody:
    """`/v1/chat/completions`. `max_tokens` None: the model's default budget, within what the context leaves;
    `audio` None: a text answer, else a spoken one in that voice and format."""

    model: str | None
    messages: tuple[ChatMessage, ...]  # media parts not yet decoded (`chat_messages.MediaPart`)
    max_tokens: int | None
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # vLLM's `chat_template_kwargs`
    max_tokens_field: str = "max_tokens"  # the name the client used, for errors
    sampling_by: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    audio: AudioOutput | None = None
    priority: int = 0
    sampling_given: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GenerateBody:
    """`/generate`, the native route: one prompt, `SamplingParams` by name.
    `walk` None is the model's default walk; `voice` is for speech walks."""

    model: str | None
    prompt: Prompt
    sampling: SamplingParams
    stream: bool = False
    voice: str | None = None
    walk: str | None = None
    sampling_given: frozenset[str] = frozenset()  # the sampling_params keys the client set
    sampling_by: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    priority: int = 0


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise RequestError("the request body is empty; expected a JSON object", field="body")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        try:  # orjson reads bytes that are not UTF-8 as "surrogates not allowed": name what is wrong
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RequestError(f"is not valid UTF-8 (byte {bad.start}); JSON bodies are UTF-8",
                               field="body") from None
        raise RequestError(f"invalid JSON: {e}", field="body") from None
    if not isinstance(obj, dict):
        raise RequestError(f"must be a JSON object, not {type_name(obj)}", field="body")
    return obj


def parse_completion(body: bytes) -> CompletionBody:
    f = Fields(parse_json_object(body))
    f.refuse_unknown(COMPLETION_KEYS)
    _refuse_openai_extras(f)
    f.unsupported_if_truthy("echo")
    f.unsupported_if_truthy("suffix")
    n = _read_n(f)
    best_of = f.integer("best_of", n, lo=1)
    if best_of != n:
        raise f.error("best_of", "is not supported (only best_of == n is accepted)")
    prompts = _read_prompts(f)
    if len(prompts) * n > MAX_CHOICES:
        # named after what the client sent: a long prompt list alone, or one multiplied by n
        raise f.error("n" if n > 1 else "prompt", f"{len(prompts)} prompts x n = {n} make {len(prompts) * n} "
                      f"choices; a request may ask for at most {MAX_CHOICES}")
    stream, include_usage, continuous_usage = _read_stream(f)
    return CompletionBody(
        model=f.string("model"),
        prompts=prompts,
        # left out: OpenAI's 16; an explicit null: the model's default budget, as vLLM reads it
        max_tokens=None if "max_tokens" in f.obj and f.obj["max_tokens"] is None
        else f.integer("max_tokens", COMPLETIONS_MAX_TOKENS, lo=1),
        sampling=read_sampling(f, f.integer("logprobs", None, lo=0, hi=MAX_LOGPROBS)),
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        sampling_by=f.sampling_by(SAMPLING_BY),
        priority=_read_priority(f),
        sampling_given=_given(f),
    )


def parse_chat(body: bytes) -> ChatBody:
    f = Fields(parse_json_object(body))
    f.refuse_unknown(CHAT_KEYS)
    _refuse_openai_extras(f)
    _refuse_chat_extras(f)
    f.unsupported_if_truthy("tools")
    f.unsupported_if_truthy("functions")
    tool_choice = f.raw("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise f.error("tool_choice", "tools are not supported")
    # max_completion_tokens replaced max_tokens in the chat API; either works.
    key = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    n = _read_n(f)
    stream, include_usage, continuous_usage = _read_stream(f)
    logprobs = _chat_logprobs(f)
    audio = read_audio_output(f, stream=stream, logprobs=logprobs is not None)
    return ChatBody(
        model=f.string("model"),
        messages=read_messages(f),
        max_tokens=f.integer(key, None, lo=1),
        sampling=read_sampling(f, logprobs),
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        add_generation_prompt=f.boolean("add_generation_prompt", True),
        template_kwargs=f.mapping("chat_template_kwargs"),
        max_tokens_field=key,
        sampling_by=f.sampling_by(SAMPLING_BY),
        audio=audio,
        priority=_read_priority(f),
        sampling_given=_given(f),
    )


def parse_generate(body: bytes) -> GenerateBody:
    f = Fields(parse_json_object(body))
    f.refuse_unknown(GENERATE_KEYS)
    if f.has("text") == f.has("input_ids"):
        raise RequestError("give exactly one of 'text' and 'input_ids'", field="text")
    prompt: Prompt
    if f.has("text"):
        prompt = f.string("text") or ""
    else:
        ids = f.raw("input_ids")
        if not is_int_list(ids) or not ids:
            raise f.error("input_ids", "must be a non-empty array of integers")
        prompt = tuple(ids)
    voice = f.string("voice")
    if voice is not None and not isinstance(prompt, str):
        raise f.error("voice", "needs 'text' (a voice speaks text, not token ids)")
    sp = Fields(f.raw("sampling_params", {}), "sampling_params.")
    sp.refuse_unknown(SAMPLING_KEYS)
    sampling = read_sampling(sp, sp.integer("logprobs", None, lo=0, hi=MAX_LOGPROBS))
    max_tokens = sp.integer("max_tokens", SamplingParams.max_tokens, lo=1)
    return GenerateBody(
        model=f.string("model"),
        prompt=prompt,
        sampling=dataclasses.replace(sampling, max_tokens=max_tokens),
        stream=f.boolean("stream"),
        voice=voice,
        walk=f.string("walk"),
        sampling_given=frozenset(k for k, v in sp.obj.items() if v is not None),
        sampling_by=f.sampling_by(SAMPLING_BY),
        priority=_read_priority(f),
    )


def read_sampling(f: Fields, logprobs: int | None = None) -> SamplingParams:
    """Every `SamplingParams` field but `max_tokens`, which needs the prompt
    length to resolve, and `logprobs`, which each route spells its own way;
    ranges are `SamplingParams.validate`'s."""
    params = SamplingParams(
        temperature=f.number("temperature", 1.0),
        top_p=f.number("top_p", 1.0),
        top_k=f.integer("top_k", 0),
        min_p=f.number("min_p", 0.0),
        repetition_penalty=f.number("repetition_penalty", 1.0),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        seed=f.seed(),
        stop=f.stops("stop"),
        stop_token_ids=f.int_list("stop_token_ids"),
        ignore_eos=f.boolean("ignore_eos"),
        min_tokens=f.integer("min_tokens", 0),
        logprobs=logprobs,
        skip_special_tokens=f.boolean("skip_special_tokens", True),
        include_stop_str_in_output=f.boolean("include_stop_str_in_output"),
    )
    try:  # max_tokens is the route's, once the prompt is known: a min_tokens is checked against it then
        dataclasses.replace(params, max_tokens=None).validate()
    except RequestError as e:
        raise RequestError(e.message, field=f.name(e.field) if e.field else None,
                           status=e.status, code=e.code) from None
    return params


# ----------------------------------------------------------------- helpers


def _given(f: Fields) -> frozenset[str]:
    """The body's keys with a value (null is the default, as left out)."""
    return frozenset(k for k, v in f.obj.items() if v is not None)


def _read_priority(f: Fields) -> int:
    """mstar's (and vLLM's) `priority`: lower is served first among waiting requests."""
    value = f.integer("priority", 0, lo=-(2**31), hi=2**31 - 1)
    assert value is not None
    return value


def _refuse_openai_extras(f: Fields) -> None:
    """OpenAI features we do not implement: refused, never silently ignored."""
    f.unsupported_if_truthy("logit_bias")
    f.string("user")
    fmt = f.raw("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("json_object", "json_schema"):
            raise f.error("response_format", f"'{kind}' is not supported; only 'text' is")
        if kind != "text":
            raise f.error("response_format", "must be an object with type 'text'")


def _refuse_chat_extras(f: Fields) -> None:
    """Chat fields that ask for nothing this server lacks are read and
    type-checked; those that would change the answer are refused."""
    metadata = Fields(f.raw("metadata", {}), "metadata.")
    for key in metadata.obj:
        metadata.string(key)
    for key in ("safety_identifier", "prompt_cache_key"):
        f.string(key)
    f.boolean("parallel_tool_calls", True)
    if f.boolean("store"):
        raise f.error("store", "storing completions is not supported")
    tier = f.string("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise f.error("service_tier", f"only {list(SERVICE_TIERS)} are supported, got '{tier}'")
    if f.raw("function_call") not in (None, "none", "auto"):
        raise f.error("function_call", "functions are not supported")
    for key in ("prediction", "reasoning_effort", "verbosity", "web_search_options"):
        f.unsupported_if_truthy(key)


def _chat_logprobs(f: Fields) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs` (0 if left out) as one count."""
    wanted = f.boolean("logprobs")
    top = f.integer("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise f.error("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def _read_n(f: Fields) -> int:
    n = f.integer("n", 1, lo=1, hi=MAX_N)
    assert n is not None
    return n


def _read_stream(f: Fields) -> tuple[bool, bool, bool]:
    """`stream`, and whether the usage ends the stream and is in every chunk."""
    stream = f.boolean("stream")
    if not f.has("stream_options"):
        return stream, False, False
    if not stream:
        raise f.error("stream_options", "is only allowed when stream is true")
    opts = Fields(f.raw("stream_options"), "stream_options.")
    opts.refuse_unknown(STREAM_OPTIONS)
    if opts.boolean("include_obfuscation"):  # OpenAI's padding of stream events; false asks for what is served
        raise opts.error("include_obfuscation", "is not supported (only false is accepted)")
    include, continuous = opts.boolean("include_usage"), opts.boolean("continuous_usage_stats")
    return stream, include, include and continuous


def _read_prompts(f: Fields) -> tuple[Prompt, ...]:
    """A string, token ids, or an array of either (one choice set per prompt)."""
    value = f.raw("prompt")
    if value is None:
        raise f.error("prompt", "is required")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and not isinstance(value[0], (str, list)):
        # An array that starts with a number is one prompt of token ids.
        if not is_int_list(value):
            raise f.error("prompt", "an array of token ids must hold integers only")
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise f.error("prompt", "must be a string, an array of token ids, or a non-empty array of either")
    out: list[Prompt] = []
    for i, item in enumerate(items):
        # "" is a prompt (of just the tokenizer's BOS, if it has one); an
        # empty token array is not, as nothing would condition the model.
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and is_int_list(item):
            out.append(tuple(item))
        else:
            raise RequestError("must be a string or a non-empty array of token ids",
                               field=_index("prompt", i, len(items)))
    return tuple(out)


def _index(key: str, i: int, count: int) -> str:
    return key if count == 1 and i == 0 else f"{key}[{i}]"
