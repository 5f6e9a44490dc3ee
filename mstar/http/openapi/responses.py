"""JSON Schemas of the answers, for `openapi.py`: the shapes that
`openai_routes.py`, `native_routes.py`, `speech_routes.py` and
`responses.py` write, including each stream's events."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

FINISH_REASON: Schema = {"enum": ["stop", "length", "abort", "error", "timeout", None]}
NULLABLE_STRING: Schema = {"type": ["string", "null"]}

ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"enum": ["invalid_request_error", "requests", "server_error"],
                     "description": "`requests` for a 429 (too many requests waiting), `server_error` for a 5xx"},
            "param": {**NULLABLE_STRING, "description": "the offending field, with its path"},
            "code": NULLABLE_STRING,
        },
    }},
}

USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "completion_tokens_details": {
            "type": "object", "properties": {k: {"type": "integer"} for k in ("text_tokens", "audio_tokens")},
            "description": "a spoken chat answer's: `completion_tokens` told apart, `audio_tokens` those the "
                           "model's speech side sampled (Qwen3-Omni's talker: a frame of 80 ms each, and the one "
                           "that ended it)"},
    },
}

HEALTH: Schema = {
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"enum": ["ok", "unhealthy"]},
        "model": {"type": "string"},
        "devices": {"type": "array", "items": {"type": "object"}},
        "requests_running": {"type": "integer"},
        "tensors_held": {"type": "integer"},
    },
}

MODEL: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "max_model_len"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"},
                   "root": {"type": "string", "description": "vLLM's: the model it serves (its id here)"},
                   "parent": {"type": "null", "description": "vLLM's: the model an adapter is of (none here)"},
                   "voices": {"type": "array", "items": {"type": "string"},
                              "description": "a speech model's voices (empty for others)"},
                   "input_modalities": {"type": "array", "items": {"enum": ["text", "audio", "image"]},
                                        "description": "what its chat messages may hold: `text` always; `audio` "
                                                       "takes `input_audio` parts, `image` takes `image_url` parts"}},
}

MODEL_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}},
}


def reply(obj: str, choice: Schema) -> Schema:
    """An OpenAI answer or stream chunk: `Reply.body` of `openai_routes.py`."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "system_fingerprint": {"type": "null"},
            "choices": {"type": "array", "items": choice},
            "usage": {"oneOf": [USAGE, {"type": "null"}],
                      "description": "in a stream: only with include_usage, the totals on the last chunk"},
        },
    }


def choice(logprobs: Schema, **fields: Schema) -> Schema:
    return {"type": "object", "required": ["index", *fields, "finish_reason"],
            "properties": {"index": {"type": "integer"}, **fields,
                           "logprobs": {"oneOf": [logprobs, {"type": "null"}],
                                        "description": "null unless the request asked; in a stream, of the "
                                                       "chunk's tokens"},
                           "finish_reason": FINISH_REASON,
                           "stop_reason": {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
                                           "description": "vLLM's: the stop string or stop_token_ids id that ended "
                                                          "the choice (finish_reason stop); null for EOS, other "
                                                          "ends, and before the end"}}}


NUMBERS: Schema = {"type": "array", "items": {"type": "number"}}
COMPLETION_LOGPROBS: Schema = {
    "type": "object",
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": NUMBERS,
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}},
                         "description": "token -> logprob of the most likely tokens, and of the sampled one"},
        "text_offset": {"type": "array", "items": {"type": "integer"},
                        "description": "characters of the token strings before each token, in the choice's text"},
    },
}
TOKEN_LOGPROB: Schema = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                   "bytes": {"type": "array", "items": {"type": "integer"}}},
}
CHAT_LOGPROBS: Schema = {
    "type": "object",
    "properties": {"content": {"type": "array", "items": {
        **TOKEN_LOGPROB, "required": [*TOKEN_LOGPROB["required"], "top_logprobs"],
        "properties": {**TOKEN_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": TOKEN_LOGPROB}}}}},
}
NATIVE_LOGPROBS: Schema = {
    "type": "array",
    "items": {"type": "object", "properties": {
        "token_id": {"type": "integer"}, "logprob": {"type": "number"},
        "top_logprobs": {"type": "array", "items": {"type": "object", "properties": {
            "token_id": {"type": "integer"}, "logprob": {"type": "number"}}}}}},
    "description": "with sampling_params.logprobs: one entry per token of `token_ids`",
}

SPOKEN: Schema = {
    "type": "object",
    "required": ["id", "data", "expires_at", "transcript"],
    "properties": {
        "id": {"type": "string"},
        "data": {"type": "string", "contentEncoding": "base64",
                 "description": "the whole answer's audio, in the request's `audio.format`"},
        "expires_at": {"type": "integer",
                       "description": "until when a later turn may name this answer by its id (an assistant "
                                      "message's `audio.id`): its transcript is kept an hour"},
        "transcript": {"type": "string", "description": "the answer's text"},
    },
}
SPOKEN_PIECE: Schema = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "description": "the choice's audio, the same in each of its pieces"},
        "data": {"type": "string", "contentEncoding": "base64",
                 "description": "the next piece of the audio: 16-bit PCM, 24 kHz mono"},
        "transcript": {"type": "string", "description": "the next piece of the answer's text"},
        "expires_at": {"type": "integer", "description": "only in the choice's last piece, which has nothing else"},
    },
}
MESSAGE: Schema = {"type": "object", "properties": {
    "role": {"const": "assistant"},
    "content": {"type": ["string", "null"], "description": "null in a spoken answer: its text is the transcript"},
    "refusal": {"type": "null", "description": "OpenAI's: the model's refusal, never made here"},
    "annotations": {"type": "array", "maxItems": 0, "description": "OpenAI's: citations, never made here"},
    "audio": {**SPOKEN, "description": "a spoken answer's"}}}
DELTA: Schema = {"type": "object", "properties": {
    "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
    "audio": {**SPOKEN_PIECE, "description": "a spoken answer's"}}}
COMPLETION = reply("text_completion", choice(COMPLETION_LOGPROBS, text={"type": "string"}))
CHAT_COMPLETION = reply("chat.completion", choice(CHAT_LOGPROBS, message=MESSAGE))
CHAT_CHUNK = reply("chat.completion.chunk", choice(CHAT_LOGPROBS, delta=DELTA))

SSE_DESCRIPTION = ("server-sent events: each `data: {json}` frame a chunk, the stream ending with "
                   "`data: [DONE]`; a failure after the headers is an `{\"error\": ...}` frame")
# OpenAI's speech stream has no `[DONE]`: a client waiting for one would wait past the end.
SPEECH_SSE_DESCRIPTION = ("server-sent events: each `data: {json}` frame a `speech.audio.delta`, the stream "
                          "ending with a `speech.audio.done` frame carrying the usage (no `data: [DONE]`); a "
                          "failure after the headers is a last `{\"type\": \"error\", \"error\": ...}` frame")


def sse(event: Schema, description: str = SSE_DESCRIPTION) -> Schema:
    # OpenAPI 3.1 has no schema for event streams; the event's schema rides along for readers.
    return {"type": "string", "description": description, "x-event-schema": event}


AUDIO_B64: Schema = {"type": "string", "contentEncoding": "base64", "description": "PCM16 little-endian mono"}

GENERATE: Schema = {
    "type": "object",
    "required": ["request_id", "text", "token_ids", "finish_reason", "usage"],
    "properties": {
        "request_id": {"type": "string"}, "text": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "logprobs": NATIVE_LOGPROBS,
        "audio": AUDIO_B64, "sample_rate": {"type": "integer"},
        "finish_reason": FINISH_REASON, "usage": USAGE,
    },
}

GENERATE_LINE: Schema = {
    "type": "object",
    "required": ["request_id", "finished"],
    "properties": {
        "request_id": {"type": "string"}, "text": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "logprobs": NATIVE_LOGPROBS,
        "audio": AUDIO_B64, "sample_rate": {"type": "integer"},
        "finished": {"type": "boolean"},
        "finish_reason": FINISH_REASON, "usage": USAGE,
        "error": ERROR["properties"]["error"],
    },
    "description": "one line per chunk; the last has `finished`, its `finish_reason` and `usage`, or an `error`",
}

SPEECH_EVENT: Schema = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["speech.audio.delta", "speech.audio.done", "error"]},
        "audio": {"type": "string", "contentEncoding": "base64",
                  "description": "the next piece of the encoded `response_format` stream"},
        "usage": {"type": "object", "properties": {
            k: {"type": "integer"} for k in ("input_tokens", "output_tokens", "total_tokens")}},
        "error": ERROR["properties"]["error"],
    },
}

TOKENIZE: Schema = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": "array", "items": {"type": ["string", "null"]},
                       "description": "with `return_token_strs`: each token's vocabulary string"},
    },
}

DETOKENIZE: Schema = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
