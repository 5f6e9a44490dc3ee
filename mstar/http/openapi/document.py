"""The OpenAPI 3.1 document of every route `server.build_app` serves.

Built once, on first use, from the request schemas of `schemas.py`
(whose bounds and enums are the parsers' own constants) and the answer
schemas of `responses.py`. `GET /openapi.json` serves it.
"""

from __future__ import annotations

import functools
from typing import Any

from mstar.http.openapi import responses as out
from mstar.http.openapi import schemas as req
from mstar.http.speech.audio import CONTENT_TYPES

Schema = dict[str, Any]

VERSION = "0.1.0"  # pyproject's; the package may run uninstalled, so not read from its metadata


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {400: "the request is malformed or out of range; `param` names the field",
           404: "unknown model (POST) or no such route", 500: "an unexpected server failure",
           429: "too many requests are waiting to start (`type` `requests`, `code` `queue_full`); retry after the "
                "`Retry-After` header's seconds",
           503: "the engine is not running; retry after the `Retry-After` header's seconds",
           413: "the request body is larger than the server accepts; the message gives the limit",
           504: "the request ran past the server's --request-timeout (a stream ends with an error event instead)",
           426: "a plain request to a websocket route: open it with `Upgrade: websocket` (the header says so)"}
    retry = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
    return {str(s): {"description": why[s], "content": _json(req.ref("Error")),
                     **({"headers": retry} if s in (429, 503) else {})} for s in statuses}


def _post(summary: str, body: str, ok: dict[str, Any], ok_description: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(req.ref(body))},
        "responses": {"200": {"description": ok_description, "content": ok},
                      **_errors(400, 404, 413, 429, 500, 503, 504)},
    }}


def _get(summary: str, ok: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary, "content": ok},
                                                      **_errors(500), **extra}}}


@functools.cache
def document() -> Schema:
    """The document; callers must not mutate it (it is shared)."""
    speech_ok = {media: {"schema": {"type": "string", "contentMediaType": media}}
                 for media in sorted(set(CONTENT_TYPES.values()))}
    speech_ok["text/event-stream"] = {"schema": out.sse(req.ref("SpeechEvent"), out.SPEECH_SSE_DESCRIPTION)}
    demo_file = _get("a file of the browser demo", {media: {"schema": {"type": "string"}} for media in
                                                    ("text/html", "text/css", "text/javascript")},
                     **{"404": {"description": "no such file", "content": _json(req.ref("Error"))}})
    demo_file["get"]["parameters"] = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
                                       "description": "the file's name, e.g. demo.js"}]
    model = _get("one served model", _json(req.ref("Model")),
                 **{"404": {"description": "the model is not served here (code `model_not_found`)",
                            "content": _json(req.ref("Error"))}})
    model["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                                   "description": "the model's id, as `/v1/models` lists it"}]
    paths = {
        "/health": _get("engine liveness and load", _json(req.ref("Health")),
                        **{"503": {"description": "a worker died", "content": _json(req.ref("Health"))}}),
        "/metrics": _get("Prometheus metrics, text format 0.0.4", {"text/plain": {"schema": {"type": "string"}}}),
        "/openapi.json": _get("this document", _json({"type": "object"})),
        "/v1/models": _get("the served models", _json(req.ref("ModelList"))),
        "/v1/models/{model}": model,
        "/": _get("the browser demo page", {"text/html": {"schema": {"type": "string"}}}),
        "/static/{name}": demo_file,
        "/v1/completions": _post("OpenAI text completions", "CompletionRequest", {
            **_json(req.ref("Completion")), "text/event-stream": {"schema": out.sse(req.ref("Completion"))}},
            "the completion; with `stream`, its chunks as server-sent events"),
        "/v1/chat/completions": _post("OpenAI chat completions", "ChatRequest", {
            **_json(req.ref("ChatCompletion")),
            "text/event-stream": {"schema": out.sse(req.ref("ChatCompletionChunk"))}},
            "the completion; with `stream`, its chunks as server-sent events"),
        "/generate": _post("native generation: text or token ids, SamplingParams by name", "GenerateRequest", {
            **_json(req.ref("GenerateResponse")),
            "application/x-ndjson": {"schema": {"type": "string", "x-line-schema": req.ref("GenerateLine")}}},
            "the answer; with `stream`, one JSON object per line (NDJSON)"),
        "/tokenize": _post("vLLM's: the token ids a prompt or chat starts from, as the completion routes prepare "
                           "them", "TokenizeRequest", _json(req.ref("TokenizeResponse")), "the ids and their count"),
        "/detokenize": _post("vLLM's: the text of token ids", "DetokenizeRequest",
                             _json(req.ref("DetokenizeResponse")), "their text, special tokens included"),
        "/v1/audio/speech": _post("OpenAI text to speech, streamed", "SpeechRequest", speech_ok,
                                  "the audio in `response_format` (header X-Sample-Rate) as it is produced, or "
                                  "with `stream_format: sse` its base64 pieces as events; with `stream: false` "
                                  "one file of known length whose header has the true sizes"),
        "/v1/realtime": {"get": {
            "summary": "the OpenAI Realtime API (GA events) over a websocket",
            "description": "Upgrade to a websocket, then exchange Realtime events as JSON text messages: "
                           "session.update, conversation.item.create, response.create, response.cancel, ... in; "
                           "session.created, response.output_audio.delta, response.done, error, ... out. Text "
                           "sent while a speech response runs is spoken in the same request.",
            "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                            "description": "the served model (default: the one the server runs)"}],
            "responses": {"101": {"description": "switching to the websocket protocol"},
                          **_errors(400, 404, 426, 500)}}},
    }
    # text streamed in while the audio streams out: the body's first line, then {"input": ...} lines
    paths["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/x-ndjson"] = {"schema": {
        "type": "string", "x-line-schema": req.ref("SpeechRequest"),
        "description": "first line: the JSON body; each later line {\"input\": \"more text\"} is spoken after "
                       "what came before, in the same request; the body's end ends the input. A later line "
                       "refused (as `input` is, or past the context) ends the request: a 400 before any audio, "
                       "an `error` event on an SSE stream, an audio body cut short"}}
    for path in ("/health", "/", "/static/{name}"):  # open with or without --api-key
        paths[path]["get"]["security"] = []
    schemas = {
        "CompletionRequest": req.COMPLETION_REQUEST, "ChatRequest": req.CHAT_REQUEST,
        "GenerateRequest": req.GENERATE_REQUEST, "SpeechRequest": req.SPEECH_REQUEST,
        "TokenizeRequest": req.TOKENIZE_REQUEST, "DetokenizeRequest": req.DETOKENIZE_REQUEST,
        "TokenizeResponse": out.TOKENIZE, "DetokenizeResponse": out.DETOKENIZE,
        "Error": out.ERROR, "Health": out.HEALTH, "ModelList": out.MODEL_LIST, "Model": out.MODEL,
        "Completion": out.COMPLETION,
        "ChatCompletion": out.CHAT_COMPLETION, "ChatCompletionChunk": out.CHAT_CHUNK,
        "GenerateResponse": out.GENERATE, "GenerateLine": out.GENERATE_LINE, "SpeechEvent": out.SPEECH_EVENT,
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "mstar", "version": VERSION,
                 "description": "A serving system for composite multimodal models. Optional request fields "
                                "may also be null, which means their default."},
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": paths,
        # the key is asked for only when the server runs with --api-key: either entry satisfies the document
        "security": [{"bearer": []}, {}],
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "`Authorization: Bearer <key>` when the server runs with --api-key; the realtime "
                           "websocket also takes the subprotocol `openai-insecure-api-key.<key>`"}}},
    }
