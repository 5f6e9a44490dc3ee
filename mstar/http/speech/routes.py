"""`POST /v1/audio/speech`, OpenAI-compatible text to speech, streamed.

The text and voice go to the model's text-to-speech walk (`Model.tts_walk`:
Orpheus's `speak`, Qwen3-Omni's `tts`), with the model's defaults for that
walk under the sampling fields the client gave; its PCM16 chunks, at the
rate they carry, go out as they are produced, encoded in the requested
`response_format` (see `audio.py`): either as the audio body itself (chunked transfer) or, with
`stream_format: "sse"`, as `speech.audio.delta` events carrying base64 pieces
of that same encoded stream, closed by `speech.audio.done` with the usage.
With `stream: false` the whole audio is gathered first and sent as one file
of known length whose header carries its true sizes.

Headers wait for the first audio: a request that fails before producing any
gets a JSON error with its status. A failure after audio went out cannot
change the status any more: an SSE stream gets an `error` event, an audio
body is cut off (the connection closes before the chunked body's end, which
HTTP clients report as an incomplete read). A client that hangs up aborts its
engine request.

Text can also stream in while the audio streams out, for a model whose
text-to-speech walk takes input while it runs (Orpheus's; another model's
refuses such a body with a 400 naming `input`): a body of content type
`application/x-ndjson` is read line by line. Its first line is the JSON body
above; each later line, `{"input": "more text"}`, is spoken after what came
before, in the same engine request (one more turn on the same KV cache, no
prompt prefilled again). The end of the body ends the input. A later line
that is refused (see `streamed_input.py`) ends the request, and the client is
told as a failure is: a JSON 400 naming the field before any audio, an
`error` event on an SSE stream, an audio body cut short (and logged).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import orjson
import structlog
from aiohttp import web

from mstar.errors import MstarError, RequestError
from mstar.http.speech.audio import CONTENT_TYPES, AudioEncoder, encode_whole, encoder_for
from mstar.http.ids import uuid4_hex
from mstar.http.keys import ENGINE, TARGETS
from mstar.http.responses import client_gone, error_body, request_error_body
from mstar.http.speech.streamed_input import StreamedInput
from mstar.http.speech.protocol import SpeechBody, parse_speech
from mstar.http.submission import (Choice, ClientGone, GenerationFailed, Inputs, Submission, failure_of,
                                   spoken_names, submit)
from mstar.types import OutputChunk, SamplingParams

log = structlog.get_logger("mstar.http")

DEFAULT_SAMPLE_RATE = 24_000  # only for a request that ends without any audio to say otherwise

Chunks = AsyncIterator[tuple[Any, OutputChunk]]
# why a finished choice has no answer to give, if it has none
Failure = Callable[[Choice], MstarError | None]


NDJSON = "application/x-ndjson"


async def speech(request: web.Request) -> web.StreamResponse:
    streamed = request.content_type == NDJSON
    body = parse_speech(await request.content.readline() if streamed else await request.read())
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(body.model)
    if target.tts_walk is None:
        raise RequestError(f"model '{target.name}' does not speak: it has no text-to-speech walk (its walks: "
                           f"{', '.join(target.walks)})", field="model")
    walk = target.tts_walk
    if body.early_audio:
        if target.early_tts_walk is None:
            raise RequestError(f"model '{target.name}' has no early-audio walk", field="early_audio")
        walk = target.early_tts_walk
    sampling = speech_sampling(target.tts_sampling, body)
    # no voice: the model's default one
    values = {"text": body.input, **({"voice": body.voice} if body.voice is not None else {})}
    spoken = Inputs(values, spoken_names("input", "max_tokens" if "max_tokens" in body.sampling else None))
    sub = await submit(engine, f"speech-{uuid4_hex()}", target.name, [spoken], sampling, walk=walk,
                       sampling_by=body.sampling_by, more_input=streamed, keep_audio=not body.stream)
    more = StreamedInput(request, engine, sub.streams[0].request_id) if streamed else None

    def failed(choice: Choice) -> MstarError | None:
        refused = more.refused(choice.finish_reason) if more is not None else None
        return refused or failure_of(choice)

    try:
        if not body.stream:
            return await _whole(request, sub, body.response_format, failed)
        async with aclosing(sub.chunks()) as chunks:
            first = await _first_audio(request, chunks, failed)
            encoder = encoder_for(body.response_format, first.sample_rate or DEFAULT_SAMPLE_RATE)
            if body.stream_format == "sse":
                return await _stream_sse(request, sub, chunks, first, encoder, failed)
            return await _stream_audio(request, chunks, first, encoder, failed)
    finally:
        if more is not None:
            more.cancel()
        await sub.aclose()


def speech_sampling(defaults: SamplingParams, body: SpeechBody) -> SamplingParams:
    """The model's defaults with what the client gave on top. The engine
    range-checks them when it prepares the request; the fields keep their
    body names in its errors (`spoken_names`)."""
    return defaults.replace(**body.sampling)


async def _whole(request: web.Request, sub: Submission, response_format: str, failed: Failure) -> web.Response:
    """All the audio, then one answer of known length (any failure is still
    a JSON error): a file whose header has the true sizes."""
    async for _ in sub.chunks(client_gone(request)):
        pass
    [choice] = sub.choices
    if choice.finish_reason is None:
        raise ClientGone()
    failure = failed(choice)
    if failure is not None:
        raise failure
    rate = choice.sample_rate or DEFAULT_SAMPLE_RATE
    data = await asyncio.to_thread(encode_whole, response_format, rate, bytes(choice.audio or b""))
    return web.Response(body=data, content_type=CONTENT_TYPES[response_format],
                        headers={"X-Sample-Rate": str(rate), "Cache-Control": "no-cache"})


async def _first_audio(request: web.Request, chunks: Chunks, failed: Failure) -> OutputChunk:
    """Wait for the first chunk with audio, or the end: raises the failure of
    a request that ended without audio, or `ClientGone`."""
    gone = client_gone(request)
    async for choice, chunk in chunks:
        if chunk.finished:
            failure = failed(choice)
            if failure is not None:
                raise failure
        if chunk.audio or chunk.finished:
            return chunk
        if gone():
            break
    raise ClientGone()


async def _open(request: web.Request, content_type: str, sample_rate: int) -> web.StreamResponse:
    response = web.StreamResponse(status=200)
    response.content_type = content_type
    response.headers["Cache-Control"] = "no-cache"
    # Proxies such as nginx would otherwise hold audio back in a buffer.
    response.headers["X-Accel-Buffering"] = "no"
    # Raw PCM says nothing of its rate; the header does (every format gets it).
    response.headers["X-Sample-Rate"] = str(sample_rate)
    # no length: aiohttp chunks the body for HTTP/1.1 and ends it by closing the connection for HTTP/1.0
    try:
        await response.prepare(request)
    except ConnectionError:
        raise ClientGone() from None
    return response


async def _encoded(chunks: Chunks, first: OutputChunk, encoder: AudioEncoder,
                   failed: Failure) -> AsyncIterator[bytes]:
    """The response's audio, encoded as it comes: the encoder's start, one
    piece per PCM chunk, its end (any of them may be empty)."""
    yield encoder.start()
    async with aclosing(_audio_chunks(chunks, first, failed)) as pcm:
        async for piece in pcm:
            yield encoder.push(piece)
    yield encoder.finish()


async def _stream_audio(request: web.Request, chunks: Chunks, first: OutputChunk,
                        encoder: AudioEncoder, failed: Failure) -> web.StreamResponse:
    response = await _open(request, encoder.content_type, first.sample_rate or DEFAULT_SAMPLE_RATE)
    write = response.write

    # One loop over the request's chunks, not `_encoded`'s generators: at hundreds of streams every
    # chunk's pass through the event loop holds the GIL that the device worker needs.
    try:
        for data in (encoder.start(), encoder.push(first.audio) if first.audio else b""):
            if data:  # an empty chunk would end a chunked body
                await write(data)
        if not first.finished:
            async for choice, chunk in chunks:
                if chunk.audio and (data := encoder.push(chunk.audio)):
                    await write(data)
                if chunk.finished:
                    failure = failed(choice)
                    if failure is not None:
                        raise failure
                    break
        if data := encoder.finish():
            await write(data)
        await response.write_eof()
    except (GenerationFailed, RequestError) as e:
        log.warning("speech failed mid-stream; cutting the body short", error=e.message,
                    field=getattr(e, "field", None))
        _cut(request, response)
    except ConnectionError:
        log.info("client went away mid-stream; aborting its request")
    except Exception:
        log.exception("speech stream failed; cutting the body short")
        _cut(request, response)
    return response


async def _stream_sse(request: web.Request, sub: Submission, chunks: Chunks, first: OutputChunk,
                      encoder: AudioEncoder, failed: Failure) -> web.StreamResponse:
    response = await _open(request, "text/event-stream", first.sample_rate or DEFAULT_SAMPLE_RATE)

    async def event(obj: dict[str, Any]) -> None:
        await response.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def delta(data: bytes) -> None:
        if data:
            await event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    try:
        async with aclosing(_encoded(chunks, first, encoder, failed)) as parts:
            async for data in parts:
                await delta(data)
        usage = sub.usage()
        await event({"type": "speech.audio.done", "usage": {"input_tokens": usage["prompt_tokens"],
                     "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"]}})
        await response.write_eof()
    except ConnectionError:
        log.info("client went away mid-stream; aborting its request")
    except GenerationFailed as e:
        log.warning("speech failed mid-stream", error=e.message)
        await _end_with_error(response, event, error_body(e.message, status=e.status, code=e.code))
    except RequestError as e:
        log.warning("speech input refused mid-stream", error=e.message, field=e.field)
        await _end_with_error(response, event, request_error_body(e))
    except Exception:
        log.exception("speech stream failed")
        await _end_with_error(response, event, error_body("internal server error", status=500,
                                                          code="internal_error"))
    return response


async def _audio_chunks(chunks: Chunks, first: OutputChunk, failed: Failure) -> AsyncIterator[bytes]:
    """The PCM of `first` and of every chunk after it, until the request ends;
    raises its failure (`failed`) if it ended in one."""
    if first.audio:
        yield first.audio
    if first.finished:
        return
    async for choice, chunk in chunks:
        if chunk.audio:
            yield chunk.audio
        if chunk.finished:
            failure = failed(choice)
            if failure is not None:
                raise failure
            return


async def _end_with_error(response: web.StreamResponse, event: Any, body: dict[str, Any]) -> None:
    """An `error` event (OpenAI's error shape under `error`), then the end.
    The client may be gone already; then there is no one to tell."""
    try:
        await event({"type": "error", **body})
        await response.write_eof()
    except ConnectionError:
        pass


def _cut(request: web.Request, response: web.StreamResponse) -> None:
    """End the connection without the chunked body's terminator, so the
    client sees a truncated answer rather than a complete-looking file."""
    response.force_close()
    transport = request.transport
    if transport is not None:
        transport.close()
