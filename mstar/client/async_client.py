"""`AsyncClient`: keyword arguments in, an mstar server's answers out, over
aiohttp, on the caller's event loop (so `await` works wherever a loop already
runs, a Jupyter cell included).

Each method builds one route's JSON body, sends it (retrying 429 and 503 when
allowed) and returns a result dataclass, or with `stream=True` an async
iterator of chunks that reads the body as the server writes it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping, Sequence
from types import TracebackType
from urllib.parse import quote
from typing import Any, Literal, Self, TypeVar, Unpack, overload

import aiohttp

from mstar.client.audio import Speech
from mstar.client.errors import RETRYABLE, MstarError, connection_error, error_from_body
from mstar.client.events import ndjson_events, sse_events
from mstar.client.handshake import refusal_trace
from mstar.client.realtime import AsyncRealtimeSession
from mstar.client.results import Completion, Generation, Health, ModelCard
from mstar.client.sampling import ChatOptions, Sampling, TextSampling
from mstar.client.streams import TRANSPORT_ERRORS, AsyncSpeechStream, AsyncStream

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 600.0  # the server's own --request-timeout default
MAX_BACKOFF = 8.0        # seconds between retries when the server names no Retry-After

# A completions prompt: text, token ids, or a batch of either.
Prompt = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]
Events = Callable[[aiohttp.StreamReader], AsyncGenerator[dict[str, Any], None]]


class AsyncClient:
    """A client of one mstar server.

    `timeout` bounds, in seconds, the connect and each wait for more of an
    answer (not a whole stream, which may rightly run for minutes); None waits
    forever. `api_key` (a server's `--api-key`) is sent as a bearer token on
    every request, the realtime websocket's included.
    `max_retries` retries a 429 or 503 that many times, after the server's
    Retry-After (else a doubling backoff).

    The aiohttp session opens on first use, on the loop of that use; keep one
    client per event loop, and `aclose()` it (or use `async with`).
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, timeout: float | None = DEFAULT_TIMEOUT,
                 api_key: str | None = None, max_retries: int = 0, headers: Mapping[str, str] | None = None) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.headers = dict(headers or {})
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    async def session(self) -> aiohttp.ClientSession:
        """The client's aiohttp session, opened on the running loop the first time."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
            self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers,
                                                  trace_configs=[refusal_trace()])
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("this AsyncClient's session belongs to another event loop; use one client per loop")
        return self._session

    async def realtime(self, model: str | None = None, **update: Any) -> AsyncRealtimeSession:
        """A session on `/v1/realtime` (`update`: `session.update` fields such
        as voice, max_output_tokens, input_linger_ms, sent once connected).
        A refused upgrade raises `MstarError` with the server's status, code
        and Retry-After; `timeout` bounds the connect and each of the
        session's waits for an event, as it does an HTTP answer's."""
        url = self.url("/v1/realtime").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        if model is not None:
            url += f"?model={quote(model)}"
        return await AsyncRealtimeSession.connect(await self.session(), url, timeout=self.timeout, **update)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # ------------------------------------------------------------ plain routes

    async def health(self) -> Health:
        """`/health`; an unhealthy server answers 503 with the same report,
        which comes back here with `ok` False rather than as an error."""
        response, _ = await self._send("GET", "/health", allow={503})
        return Health.of(await _read_json(response))

    async def models(self) -> list[ModelCard]:
        response, _ = await self._send("GET", "/v1/models")
        return [ModelCard.of(m) for m in (await _read_json(response)).get("data") or ()]

    async def model(self, name: str) -> ModelCard:
        """`/v1/models/{name}`; a model not served raises `MstarError` (404, code `model_not_found`)."""
        response, _ = await self._send("GET", "/v1/models/" + quote(name, safe=""))
        return ModelCard.of(await _read_json(response))

    async def metrics(self) -> str:
        """`/metrics`: the Prometheus text, as it is."""
        response, _ = await self._send("GET", "/metrics")
        async with response:
            return await _read(response.text())

    # ------------------------------------------------------------ generation

    @overload
    async def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ...,
                       model: str | None = ..., max_tokens: int | None = ..., voice: str | None = ...,
                       walk: str | None = ..., stream: Literal[False] = ...,
                       **sampling: Unpack[TextSampling]) -> Generation: ...

    @overload
    async def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ...,
                       model: str | None = ..., max_tokens: int | None = ..., voice: str | None = ...,
                       walk: str | None = ..., stream: Literal[True],
                       **sampling: Unpack[TextSampling]) -> AsyncStream[Generation]: ...

    @overload
    async def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ...,
                       model: str | None = ..., max_tokens: int | None = ..., voice: str | None = ...,
                       walk: str | None = ..., stream: bool,
                       **sampling: Unpack[TextSampling]) -> Generation | AsyncStream[Generation]: ...

    async def generate(self, text: str | None = None, *, input_ids: Sequence[int] | None = None,
                       model: str | None = None, max_tokens: int | None = None, voice: str | None = None,
                       walk: str | None = None, stream: bool = False,
                       **sampling: Unpack[TextSampling]) -> Generation | AsyncStream[Generation]:
        """The native `/generate`: `text` or `input_ids`; a speech model given
        a `voice` (or whose walk is `speak`) answers with audio too."""
        params = _present({"max_tokens": max_tokens, **sampling})
        body = _present({"text": text, "input_ids": list(input_ids) if input_ids is not None else None,
                         "model": model, "voice": voice, "walk": walk, "stream": stream or None,
                         "sampling_params": params or None})
        if stream:
            return await self._stream("/generate", body, ndjson_events, Generation.of)
        response, _ = await self._send("POST", "/generate", body)
        return Generation.of(await _read_json(response), finished=True)

    @overload
    async def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                          n: int | None = ..., stream: Literal[False] = ..., include_usage: bool = ...,
                          **sampling: Unpack[TextSampling]) -> Completion: ...

    @overload
    async def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                          n: int | None = ..., stream: Literal[True], include_usage: bool = ...,
                          **sampling: Unpack[TextSampling]) -> AsyncStream[Completion]: ...

    @overload
    async def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                          n: int | None = ..., stream: bool, include_usage: bool = ...,
                          **sampling: Unpack[TextSampling]) -> Completion | AsyncStream[Completion]: ...

    async def completions(self, prompt: Prompt, *, model: str | None = None, max_tokens: int | None = None,
                          n: int | None = None, stream: bool = False, include_usage: bool = False,
                          **sampling: Unpack[TextSampling]) -> Completion | AsyncStream[Completion]:
        """OpenAI's `/v1/completions`. Streamed, each chunk holds new text;
        `include_usage` adds a last chunk without choices that has the usage."""
        body = _present({"prompt": _json_prompt(prompt), "model": model, "max_tokens": max_tokens, "n": n,
                         **sampling})
        return await self._openai("/v1/completions", body, stream, include_usage)

    @overload
    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ...,
                   max_tokens: int | None = ..., n: int | None = ..., stream: Literal[False] = ...,
                   include_usage: bool = ..., **sampling: Unpack[ChatOptions]) -> Completion: ...

    @overload
    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ...,
                   max_tokens: int | None = ..., n: int | None = ..., stream: Literal[True],
                   include_usage: bool = ..., **sampling: Unpack[ChatOptions]) -> AsyncStream[Completion]: ...

    @overload
    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ...,
                   max_tokens: int | None = ..., n: int | None = ..., stream: bool, include_usage: bool = ...,
                   **sampling: Unpack[ChatOptions]) -> Completion | AsyncStream[Completion]: ...

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                   max_tokens: int | None = None, n: int | None = None, stream: bool = False,
                   include_usage: bool = False,
                   **sampling: Unpack[ChatOptions]) -> Completion | AsyncStream[Completion]:
        """OpenAI's `/v1/chat/completions`; a choice's `text` is the message
        content (streamed: the delta's, after a first chunk with the role),
        its `audio` a spoken answer's (`modalities`, `audio`: `ChatOptions`)."""
        body = _present({"messages": [dict(m) for m in messages], "model": model, "max_tokens": max_tokens,
                         "n": n, **sampling})
        return await self._openai("/v1/chat/completions", body, stream, include_usage)

    @overload
    async def speech(self, input: str, *, voice: str | None = ..., model: str | None = ...,
                     response_format: str = ..., max_tokens: int | None = ..., stream: Literal[True] = ...,
                     **sampling: Unpack[Sampling]) -> AsyncSpeechStream: ...

    @overload
    async def speech(self, input: str, *, voice: str | None = ..., model: str | None = ...,
                     response_format: str = ..., max_tokens: int | None = ..., stream: Literal[False],
                     **sampling: Unpack[Sampling]) -> Speech: ...

    @overload
    async def speech(self, input: str, *, voice: str | None = ..., model: str | None = ...,
                     response_format: str = ..., max_tokens: int | None = ..., stream: bool,
                     **sampling: Unpack[Sampling]) -> AsyncSpeechStream | Speech: ...

    async def speech(self, input: str, *, voice: str | None = None, model: str | None = None,
                     response_format: str = "pcm", max_tokens: int | None = None, stream: bool = True,
                     **sampling: Unpack[Sampling]) -> AsyncSpeechStream | Speech:
        """OpenAI's `/v1/audio/speech`. Streamed (the default), the audio
        chunks as they arrive; else the whole `Speech`, asked of the server as
        one file (`"stream": false`). Sampling left out
        takes the model's defaults (Orpheus: up to 1200 tokens)."""
        body = _present({"input": input, "voice": voice, "model": model, "response_format": response_format,
                         "max_tokens": max_tokens, **sampling})
        if not stream:
            # The server's whole answer, not a stream read to its end: a file whose header has its true
            # sizes (a streamed FLAC's sample count is "unknown", which libsndfile refuses to read), and a
            # failure as its JSON error rather than a body cut short.
            body["stream"] = False
        response, sent_at = await self._send("POST", "/v1/audio/speech", body)
        audio = AsyncSpeechStream(response, response_format, sent_at)
        if stream:
            return audio
        async with audio:
            return await audio.collect()

    # ------------------------------------------------------------ transport

    async def _openai(self, path: str, body: dict[str, Any], stream: bool,
                      include_usage: bool) -> Completion | AsyncStream[Completion]:
        if stream:
            body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
            return await self._stream(path, body, sse_events, Completion.of)
        response, _ = await self._send("POST", path, body)
        return Completion.of(await _read_json(response))

    async def _stream(self, path: str, body: dict[str, Any], events: Events,
                      parse: Callable[[dict[str, Any]], T]) -> AsyncStream[T]:
        response, _ = await self._send("POST", path, body)
        return AsyncStream(response, events(response.content), parse)

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None,
                    allow: Collection[int] = ()) -> tuple[aiohttp.ClientResponse, float]:
        """The answer (its body unread; the caller releases it) and when its
        request went out. An error status raises `MstarError`, after up to
        `max_retries` retries of a 429 or 503."""
        session = await self.session()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        attempt = 0
        while True:
            sent_at = time.perf_counter()
            try:
                response = await session.request(method, self.url(path), data=data, headers=headers)
            except TRANSPORT_ERRORS as e:
                raise connection_error(e) from e
            if response.status < 400 or response.status in allow:
                return response, sent_at
            async with response:
                raw = await _read(response.read())
            error = error_from_body(response.status, raw, response.headers, response.reason)
            if error.status not in RETRYABLE or attempt >= self.max_retries:
                raise error
            wait = error.retry_after if error.retry_after is not None else min(MAX_BACKOFF, 0.5 * 2**attempt)
            await asyncio.sleep(wait)
            attempt += 1


async def _read(body: Awaitable[T]) -> T:
    """A body read whose failed connection raises `MstarError`."""
    try:
        return await body
    except TRANSPORT_ERRORS as e:
        raise connection_error(e) from e


async def _read_json(response: aiohttp.ClientResponse) -> dict[str, Any]:
    async with response:
        raw = await _read(response.read())
    try:
        obj = json.loads(raw)
    except ValueError:
        raise MstarError(f"the server's answer is not JSON: {raw[:200]!r}", status=response.status,
                         code="invalid_response") from None
    if not isinstance(obj, dict):
        raise MstarError(f"expected a JSON object, got {type(obj).__name__}", status=response.status,
                         code="invalid_response")
    return obj


def _present(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that were given: None leaves the choice to the server."""
    return {k: v for k, v in fields.items() if v is not None}


def _json_prompt(prompt: Prompt) -> Any:
    """Sequences (tuples, ranges) as the JSON arrays the server reads."""
    if isinstance(prompt, str):
        return prompt
    return [p if isinstance(p, str) else list(p) if isinstance(p, Sequence) else p for p in prompt]
