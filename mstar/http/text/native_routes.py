"""The native route, `POST /generate`: text or token ids plus `SamplingParams`
by name come in; one JSON answer (`text`, `token_ids`, `finish_reason`,
`usage`) or an NDJSON stream (one object per chunk, the last one `finished`)
goes out. With `sampling_params.logprobs` k, the answer and each line carry
`logprobs` of their tokens: ids with their logprobs and the k most likely.

Speech models: a body with a `voice`, or whose walk (`walk`, else the
model's default) is the model's text-to-speech walk (`Model.tts_walk`),
sends its `text` and `voice` to the model as they are (the model builds its
own prompt) on `walk`, else on that walk, with the model's defaults for it
under what `sampling_params` sets. Audio comes back as base64
PCM16 (little-endian, mono) with its `sample_rate`: on each NDJSON line that
carries some, and as the whole waveform in the JSON answer. A `voice` for
a model that does not speak is refused naming it.

`sampling_by` (sampling key -> `SamplingParams` fields, mstar's, as on every
generation route) goes to the model as it is; the model checks it.
"""

from __future__ import annotations

import base64
import dataclasses
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from mstar.errors import RequestError
from mstar.http.ids import uuid4_hex
from mstar.http.keys import ENGINE, TARGETS
from mstar.http.text.logprobs import native_logprobs
from mstar.http.text.protocol import GenerateBody, parse_generate
from mstar.http.responses import EventStream, client_gone, error_body, json_response
from mstar.http.submission import (Choice, Inputs, Submission, Target, after, failure_of, first_chunk, off_loop,
                                   prompt_inputs, sampling_names, spoken_names, submit)
from mstar.types import OutputChunk

if TYPE_CHECKING:
    from mstar.engine.engine import Engine

log = structlog.get_logger("mstar.http")

SAMPLING_PREFIX = "sampling_params."  # the body's object of SamplingParams fields


async def generate(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = await off_loop(len(raw), parse_generate, raw)
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(body.model)
    request_id = f"gen-{uuid4_hex()}"
    if body.voice is not None and target.tts_walk is None:
        raise RequestError(f"model '{target.name}' has no voices: it does not speak (its walks: "
                           f"{', '.join(target.walks)})", field="voice")
    speech = body.voice is not None or target.speaks(body.walk)
    if isinstance(body.prompt, str) and speech:
        sub = await _submit_speech(engine, request_id, target, body)
    else:
        field = "text" if isinstance(body.prompt, str) else "input_ids"
        names = {**sampling_names(SAMPLING_PREFIX), "prompt": field}  # max_tokens among the sampling fields
        sampling = body.sampling if speech else target.text_sampling(body.sampling, body.sampling_given)
        sub = await submit(engine, request_id, target.name, [Inputs(prompt_inputs(body.prompt), names)],
                           sampling, walk=body.walk, sampling_by=body.sampling_by, priority=body.priority)
    try:
        if body.stream:
            return await _stream_ndjson(request, sub, request_id)
        [choice] = await sub.run_to_end(client_gone(request))
        logprobs = {"logprobs": native_logprobs(choice.logprobs)} if body.sampling.logprobs is not None else {}
        return json_response({"request_id": request_id, "text": choice.text, "token_ids": choice.token_ids,
                              **logprobs, **_audio_of(choice), "finish_reason": choice.finish_reason,
                              "usage": sub.usage()})
    finally:
        await sub.aclose()


async def _submit_speech(engine: Engine, request_id: str, target: Target, body: GenerateBody) -> Submission:
    """Text and voice to the model as they are; the model's defaults for its
    text-to-speech walk under what the client set."""
    if body.sampling.logprobs is not None:
        raise RequestError("a speech walk answers with audio, not tokens: it has no logprobs to give",
                           field="sampling_params.logprobs")
    given = {k: getattr(body.sampling, k) for k in body.sampling_given}
    sampling = dataclasses.replace(target.tts_sampling, **given)
    tokens_field = "sampling_params.max_tokens" if "max_tokens" in given else None
    values = {"text": body.prompt, **({"voice": body.voice} if body.voice is not None else {})}
    spoken = Inputs(values, spoken_names("text", tokens_field, SAMPLING_PREFIX))
    return await submit(engine, request_id, target.name, [spoken], sampling, walk=body.walk or target.tts_walk,
                        sampling_by=body.sampling_by, keep_audio=not body.stream, priority=body.priority)


def _audio_of(source: Choice | OutputChunk) -> dict[str, Any]:
    """`audio` (base64 PCM16) and `sample_rate`, if there is audio."""
    audio = source.audio
    if not audio:
        return {}
    return {"audio": base64.b64encode(audio).decode("ascii"), "sample_rate": source.sample_rate}


async def _stream_ndjson(request: web.Request, sub: Submission, request_id: str) -> web.StreamResponse:
    """One line per engine chunk, the headers with the first (a request that
    ends before any output answers with its status: `first_chunk`); a
    failure after the headers is a final line with `error`; a client that
    left ends the loop and the caller aborts."""
    async with aclosing(sub.chunks()) as chunks:
        first = await first_chunk(chunks)
        events = await EventStream.open(request, "ndjson")
        try:
            async for choice, chunk in after(first, chunks):
                line: dict[str, Any] = {"request_id": request_id, "token_ids": list(chunk.token_ids),
                                        "text": chunk.text, **_audio_of(chunk), "finished": chunk.finished}
                if chunk.logprobs is not None:
                    line["logprobs"] = native_logprobs(chunk.logprobs)
                if chunk.finished:
                    failure = failure_of(choice)
                    if failure is not None:
                        log.warning("generation failed mid-stream", error=failure.message)
                        await events.fail({**line, **error_body(failure.message, status=failure.status,
                                                                code=failure.code)})
                        return events.response
                    line["finish_reason"] = choice.finish_reason
                    line["usage"] = sub.usage()
                await events.send(line)
            await events.close()
        except ConnectionError:
            log.info("client went away mid-stream; aborting its request")
        except Exception:
            log.exception("stream failed")
            await events.fail({"request_id": request_id, "finished": True,
                               **error_body("internal server error", status=500, code="internal_error")})
    return events.response
