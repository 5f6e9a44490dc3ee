"""`Client`: the blocking twin of `AsyncClient`, same methods and arguments,
for scripts and notebooks.

Every call runs the async client's coroutine on a private event loop in a
daemon thread (`LoopThread`) and waits for it, so one code path serves both,
and a blocking call works even where the calling thread runs a loop already
(in Jupyter, call it as is; `await` an `AsyncClient` instead to keep that
loop free while waiting).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, Unpack, overload

from mstar.client.async_client import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, AsyncClient, Prompt
from mstar.client.audio import Speech
from mstar.client.loop_thread import LoopThread
from mstar.client.realtime import RealtimeSession
from mstar.client.results import Completion, Generation, Health, ModelCard
from mstar.client.sampling import ChatOptions, Sampling, TextSampling
from mstar.client.streams import AsyncSpeechStream, AsyncStream, SpeechStream, Stream


class Client:
    """A blocking client of one mstar server; see `AsyncClient` for the
    arguments. Close it (or use `with`) to end its connections and thread."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, timeout: float | None = DEFAULT_TIMEOUT,
                 api_key: str | None = None, max_retries: int = 0, headers: Mapping[str, str] | None = None) -> None:
        self.aio = AsyncClient(base_url, timeout=timeout, api_key=api_key, max_retries=max_retries, headers=headers)
        self._runner = LoopThread()
        # A client dropped without close() still ends its session and thread.
        self._finalizer = weakref.finalize(self, _shutdown, self._runner, self.aio)

    @property
    def base_url(self) -> str:
        return self.aio.base_url

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def health(self) -> Health:
        return self._runner.run(self.aio.health())

    def models(self) -> list[ModelCard]:
        return self._runner.run(self.aio.models())

    def model(self, name: str) -> ModelCard:
        return self._runner.run(self.aio.model(name))

    def metrics(self) -> str:
        return self._runner.run(self.aio.metrics())

    @overload
    def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ..., model: str | None = ...,
                 max_tokens: int | None = ..., voice: str | None = ..., walk: str | None = ...,
                 stream: Literal[False] = ..., **sampling: Unpack[TextSampling]) -> Generation: ...

    @overload
    def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ..., model: str | None = ...,
                 max_tokens: int | None = ..., voice: str | None = ..., walk: str | None = ...,
                 stream: Literal[True], **sampling: Unpack[TextSampling]) -> Stream[Generation]: ...

    @overload
    def generate(self, text: str | None = ..., *, input_ids: Sequence[int] | None = ..., model: str | None = ...,
                 max_tokens: int | None = ..., voice: str | None = ..., walk: str | None = ...,
                 stream: bool, **sampling: Unpack[TextSampling]) -> Generation | Stream[Generation]: ...

    def generate(self, text: str | None = None, *, input_ids: Sequence[int] | None = None, model: str | None = None,
                 max_tokens: int | None = None, voice: str | None = None, walk: str | None = None,
                 stream: bool = False, **sampling: Unpack[TextSampling]) -> Generation | Stream[Generation]:
        """The native `/generate`; see `AsyncClient.generate`."""
        return self._wrap(self._runner.run(self.aio.generate(
            text, input_ids=input_ids, model=model, max_tokens=max_tokens, voice=voice, walk=walk,
            stream=stream, **sampling)))

    @overload
    def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                    n: int | None = ..., stream: Literal[False] = ..., include_usage: bool = ...,
                    **sampling: Unpack[TextSampling]) -> Completion: ...

    @overload
    def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                    n: int | None = ..., stream: Literal[True], include_usage: bool = ...,
                    **sampling: Unpack[TextSampling]) -> Stream[Completion]: ...

    @overload
    def completions(self, prompt: Prompt, *, model: str | None = ..., max_tokens: int | None = ...,
                    n: int | None = ..., stream: bool, include_usage: bool = ...,
                    **sampling: Unpack[TextSampling]) -> Completion | Stream[Completion]: ...

    def completions(self, prompt: Prompt, *, model: str | None = None, max_tokens: int | None = None,
                    n: int | None = None, stream: bool = False, include_usage: bool = False,
                    **sampling: Unpack[TextSampling]) -> Completion | Stream[Completion]:
        """OpenAI's `/v1/completions`; see `AsyncClient.completions`."""
        return self._wrap(self._runner.run(self.aio.completions(
            prompt, model=model, max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage,
            **sampling)))

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ..., max_tokens: int | None = ...,
             n: int | None = ..., stream: Literal[False] = ..., include_usage: bool = ...,
             **sampling: Unpack[ChatOptions]) -> Completion: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ..., max_tokens: int | None = ...,
             n: int | None = ..., stream: Literal[True], include_usage: bool = ...,
             **sampling: Unpack[ChatOptions]) -> Stream[Completion]: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = ..., max_tokens: int | None = ...,
             n: int | None = ..., stream: bool, include_usage: bool = ...,
             **sampling: Unpack[ChatOptions]) -> Completion | Stream[Completion]: ...

    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None, max_tokens: int | None = None,
             n: int | None = None, stream: bool = False, include_usage: bool = False,
             **sampling: Unpack[ChatOptions]) -> Completion | Stream[Completion]:
        """OpenAI's `/v1/chat/completions`; see `AsyncClient.chat`."""
        return self._wrap(self._runner.run(self.aio.chat(
            messages, model=model, max_tokens=max_tokens, n=n, stream=stream, include_usage=include_usage,
            **sampling)))

    @overload
    def speech(self, input: str, *, voice: str | None = ..., model: str | None = ..., response_format: str = ...,
               max_tokens: int | None = ..., stream: Literal[True] = ...,
               **sampling: Unpack[Sampling]) -> SpeechStream: ...

    @overload
    def speech(self, input: str, *, voice: str | None = ..., model: str | None = ..., response_format: str = ...,
               max_tokens: int | None = ..., stream: Literal[False], **sampling: Unpack[Sampling]) -> Speech: ...

    @overload
    def speech(self, input: str, *, voice: str | None = ..., model: str | None = ..., response_format: str = ...,
               max_tokens: int | None = ..., stream: bool, **sampling: Unpack[Sampling]) -> SpeechStream | Speech: ...

    def speech(self, input: str, *, voice: str | None = None, model: str | None = None, response_format: str = "pcm",
               max_tokens: int | None = None, stream: bool = True,
               **sampling: Unpack[Sampling]) -> SpeechStream | Speech:
        """OpenAI's `/v1/audio/speech`; see `AsyncClient.speech`."""
        answer = self._runner.run(self.aio.speech(
            input, voice=voice, model=model, response_format=response_format, max_tokens=max_tokens,
            stream=stream, **sampling))
        return SpeechStream(self._runner, answer) if isinstance(answer, AsyncSpeechStream) else answer

    def realtime(self, model: str | None = None, **update: Any) -> RealtimeSession:
        """A blocking session on `/v1/realtime`; see `AsyncClient.realtime`."""
        return RealtimeSession(self._runner.run(self.aio.realtime(model, **update)), self._runner)

    def _wrap(self, answer: Any) -> Any:
        """A streamed answer made blocking; a whole one as it is."""
        return Stream(self._runner, answer) if isinstance(answer, AsyncStream) else answer


def _shutdown(runner: LoopThread, aio: AsyncClient) -> None:
    try:
        runner.run(aio.aclose())
    finally:
        runner.close()
