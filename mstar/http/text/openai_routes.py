"""OpenAI-compatible routes: `/v1/models` (and `/v1/models/{model}`),
`/v1/completions`, `/v1/chat/completions`.

A JSON body comes in (a chat's audio and image parts decoded off the event
loop first, by `chat_media.py`); the engine's chunks go out either as one JSON
answer or as server-sent events (`data: {...}` frames ending with
`data: [DONE]`), shaped as the OpenAI API shapes them so its clients work
unchanged. A chat that asks for audio (`modalities`, `audio`) runs on the
model's spoken-chat walk (`Model.spoken_chat_walk`) and is answered in
`chat_audio.py`'s shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from mstar.errors import ModelNotFound, RequestError
from mstar.http.ids import uuid4_hex
from mstar.http.keys import ENGINE, MEDIA, MEDIA_LIMITS, STARTED, TARGETS, TRANSCRIPTS
from mstar.http.text.chat_audio import SpokenAnswers, spoken_usage
from mstar.http.text.chat_media import chat_inputs
from mstar.http.text.logprobs import LogprobShapes
from mstar.http.text.protocol import ChatBody, parse_chat, parse_completion
from mstar.http.responses import EventStream, client_gone, error_body, json_response
from mstar.http.submission import (Choice, Inputs, Submission, Target, after, failure_of, first_chunk, off_loop,
                                   prompt_inputs, submit)
from mstar.types import ModelCard, OutputChunk

log = structlog.get_logger("mstar.http")

# a choice and its new chunk -> the entries to stream, each a streamed chunk's `choices`
Piece = Callable[[Choice, OutputChunk], list[dict[str, Any]]]


@dataclass(frozen=True)
class Reply:
    """The fields every answer (or chunk) of one request shares."""

    id: str
    object: str
    created: int
    model: str

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}


async def list_models(request: web.Request) -> web.Response:
    data = [_model(request, card, name) for card in request.app[ENGINE].model_cards()
            for name in (card.name, *card.aliases)]
    return json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: one entry of the list; 404 `model_not_found` if it is not served."""
    name = request.match_info["model"]
    card = next((c for c in request.app[ENGINE].model_cards() if c.answers_to(name)), None)
    if card is None:
        raise ModelNotFound(name)
    return json_response(_model(request, card, name))


def _model(request: web.Request, card: ModelCard, name: str) -> dict[str, Any]:
    """`card` as `/v1/models` lists it under `name` (its own or an alias)."""
    return {"id": name, "object": "model", "created": request.app[STARTED], "owned_by": "mstar",
            "root": card.root or card.name, "parent": None, "max_model_len": card.max_model_len,
            "voices": list(card.voices), "input_modalities": list(card.input_modalities)}


async def completions(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = await off_loop(len(raw), parse_completion, raw)
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(body.model)
    many = len(body.prompts) > 1
    prompts = [Inputs(prompt_inputs(p), {"prompt": f"prompt[{i}]"} if many else {})
               for i, p in enumerate(body.prompts)]
    reply = Reply(f"cmpl-{uuid4_hex()}", "text_completion", int(time.time()), target.name)
    sampling = target.text_sampling(body.sampling, body.sampling_given).replace(max_tokens=body.max_tokens)
    sub = await submit(engine, reply.id, target.name, prompts, sampling, n=body.n, sampling_by=body.sampling_by,
                       priority=body.priority, walk=text_walk(target))
    shapes = (LogprobShapes(target.tokenizer, body.sampling.skip_special_tokens)
              if body.sampling.logprobs is not None else None)
    try:
        if body.stream:
            return await stream_sse(request, sub, reply, _completion_piece(shapes), [], body.include_usage,
                                    continuous=body.continuous_usage)
        choices = await sub.run_to_end(client_gone(request))
        return json_response(reply.body([_completion_choice(c, shapes) for c in choices], usage=sub.usage()))
    finally:
        await sub.aclose()


def _spoken_cap(by: dict[str, dict[str, Any]], target: Target, body: ChatBody) -> dict[str, dict[str, Any]]:
    """A spoken answer's `max_tokens` caps its audio frames too (as realtime's
    `max_output_tokens` does): OpenAI counts audio tokens among the completion
    tokens, so a small budget must not buy minutes of speech. Its own
    `sampling_by` entry for the frames' key, if the request has one, wins."""
    key = target.spoken_audio_key
    if body.max_tokens is None or key is None or "max_tokens" in by.get(key, {}):
        return by
    return {**by, key: {**by.get(key, {}), "max_tokens": body.max_tokens}}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = await off_loop(len(raw), parse_chat, raw)
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(body.model)
    if body.audio is not None and target.spoken_chat_walk is None:
        how = ("speaks text it is given (/v1/audio/speech), not chat answers" if target.tts_walk
               else "answers in text only")
        raise RequestError(f"model '{target.name}' {how}: 'audio' needs a model that speaks its answers",
                           field="modalities")
    walk = target.spoken_chat_walk if body.audio else text_walk(target)   # refused before any media is decoded
    transcripts = request.app[TRANSCRIPTS]
    messages = transcripts.resolve(body.messages)   # earlier spoken answers named by their audio ids
    # decoded once for all n samples, before anything starts: a bad part refuses the whole request
    values, media_names = await chat_inputs(request.app[MEDIA], request.app[MEDIA_LIMITS], messages, target.name,
                                            target.input_modalities, body.add_generation_prompt, body.template_kwargs)
    names = {"max_tokens": body.max_tokens_field, **media_names}
    if body.audio is not None:
        values["voice"] = body.audio.voice
        # a prompt the talker cannot answer lacks the assistant's header
        names.update(voice="audio.voice", input="add_generation_prompt")
    reply = Reply(f"chatcmpl-{uuid4_hex()}", "chat.completion", int(time.time()), target.name)
    # max_tokens None: the model's default budget (its generation config's), within the room the messages leave
    sampling = target.text_sampling(body.sampling, body.sampling_given).replace(max_tokens=body.max_tokens)
    sub = await submit(engine, reply.id, target.name, [Inputs(values, names)], sampling, n=body.n,
                       sampling_by=_spoken_cap(body.sampling_by, target, body) if body.audio else body.sampling_by,
                       walk=walk,
                       keep_audio=body.audio is not None and not body.stream, priority=body.priority)
    shapes = LogprobShapes(target.tokenizer) if body.sampling.logprobs is not None else None
    try:  # from here on, whatever happens, the submission is closed (aborted if it still runs)
        spoken = (SpokenAnswers(body.audio, len(sub.choices), reply.created, transcripts)
                  if body.audio is not None else None)
        if body.stream:
            chunk_reply = Reply(reply.id, "chat.completion.chunk", reply.created, reply.model)
            # OpenAI opens each choice's stream with the role, before any content (a spoken answer has none).
            intro = [{"index": c.index, "delta": {"role": "assistant", "content": "" if spoken is None else None},
                      "logprobs": None, **c.ending(False)} for c in sub.choices]
            if spoken is None:
                return await stream_sse(request, sub, chunk_reply, _chat_piece(shapes), intro, body.include_usage,
                                        continuous=body.continuous_usage)
            return await stream_sse(request, sub, chunk_reply, spoken.deltas, intro, body.include_usage,
                                    lambda: spoken_usage(sub.usage(), sub.choices), continuous=body.continuous_usage)
        choices = await sub.run_to_end(client_gone(request))
        if spoken is None:
            return json_response(reply.body([_chat_message(c, shapes) for c in choices], usage=sub.usage()))
        answers = [{"index": c.index, "message": await spoken.message(c), "logprobs": None, **c.ending()}
                   for c in choices]
        return json_response(reply.body(answers, usage=spoken_usage(sub.usage(), choices)))
    finally:
        await sub.aclose()


def text_walk(target: Target) -> str | None:
    """The walk a text answer runs: the model's default (None), or where that
    one speaks (Orpheus's), its `written_walk`; a 400 where that is not served
    (`--audio-logits-only`): an answer of speech has no text to give."""
    if not target.speaks(None):
        return None
    if target.written_walk is not None and target.written_walk in target.walks:
        return target.written_walk
    raise RequestError(f"model '{target.name}' answers in speech only on this server: use /v1/audio/speech or "
                       f"/v1/realtime", field="model")


async def stream_sse(request: web.Request, sub: Submission, reply: Reply, piece: Piece,
                     intro: list[dict[str, Any]], include_usage: bool,
                     usage: Callable[[], dict[str, Any]] | None = None,
                     continuous: bool = False) -> web.StreamResponse:
    """Send a submission's chunks as SSE until every choice finished; with
    `include_usage`, then `usage()` (default: the submission's), and with
    `continuous` too, its totals so far in every chunk (vLLM's).

    The headers go out with the first chunk: a request that ends before any
    output answers with its status (`first_chunk`). A write that fails means
    the client left: we return, and the caller's `sub.aclose()` aborts what
    is still running. A failure after the headers went out is sent as an
    `{"error": ...}` event (which OpenAI's clients raise), then the stream
    ends.
    """
    usage = usage or sub.usage
    # With include_usage every chunk carries `usage: null` (or, continuous, the totals so far); the last the totals.
    def extra() -> dict[str, Any]:
        return {"usage": usage()} if continuous else {"usage": None} if include_usage else {}
    async with aclosing(sub.chunks()) as chunks:
        first = await first_chunk(chunks)
        events = await EventStream.open(request, "sse")
        try:
            for entry in intro:
                await events.send(reply.body([entry], **extra()))
            async for choice, chunk in after(first, chunks):
                if chunk.finished:
                    failure = failure_of(choice)
                    if failure is not None:
                        log.warning("generation failed mid-stream", error=failure.message)
                        await events.fail(error_body(failure.message, status=failure.status, code=failure.code))
                        return events.response
                for entry in piece(choice, chunk):
                    await events.send(reply.body([entry], **extra()))
            if include_usage:
                await events.send(reply.body([], usage=usage()))
            await events.close()
        except ConnectionError:
            log.info("client went away mid-stream; aborting its requests")
        except Exception:
            log.exception("stream failed")
            await events.fail(error_body("internal server error", status=500, code="internal_error"))
    return events.response


def _completion_piece(shapes: LogprobShapes | None) -> Piece:
    def piece(choice: Choice, chunk: OutputChunk) -> list[dict[str, Any]]:
        if not _worth_sending(chunk):
            return []
        logprobs = shapes.completion(choice.index, chunk.logprobs) if shapes and chunk.logprobs else None
        return [{"index": choice.index, "text": chunk.text, "logprobs": logprobs, **choice.ending(chunk.finished)}]
    return piece


def _worth_sending(chunk: OutputChunk) -> bool:
    # tokens whose text is held back (a possible stop string) still send their logprobs
    return bool(chunk.text or chunk.finished or chunk.logprobs)


def _completion_choice(choice: Choice, shapes: LogprobShapes | None) -> dict[str, Any]:
    return {"index": choice.index, "text": choice.text,
            "logprobs": shapes.completion(choice.index, choice.logprobs) if shapes else None, **choice.ending()}


def _chat_piece(shapes: LogprobShapes | None) -> Piece:
    def piece(choice: Choice, chunk: OutputChunk) -> list[dict[str, Any]]:
        if not _worth_sending(chunk):
            return []
        return [{"index": choice.index, "delta": {"content": chunk.text} if chunk.text else {},
                 "logprobs": shapes.chat(chunk.logprobs) if shapes and chunk.logprobs else None,
                 **choice.ending(chunk.finished)}]
    return piece


# what OpenAI's assistant message carries when the model neither refused nor cited (strict clients read them)
NO_REFUSAL: dict[str, Any] = {"refusal": None, "annotations": []}


def _chat_message(choice: Choice, shapes: LogprobShapes | None) -> dict[str, Any]:
    return {"index": choice.index, "message": {"role": "assistant", "content": choice.text, **NO_REFUSAL},
            "logprobs": shapes.chat(choice.logprobs) if shapes else None, **choice.ending()}

