"""JSON Schemas of the request and response bodies, for `openapi.py`.

Bounds and enums come from the parsers' own constants (and `SamplingParams`'
defaults and limits), so the document cannot drift from what the server
accepts. Each schema describes what the parser checks itself; what needs the
model (prompt length against the context window, voices, walks, vocabulary,
the keys of `sampling_by`) is only described in prose, and `sampling_by`'s
fields, which the model checks, are described as they are checked. As the
parsers do, an optional field that is `null` means its default; the schemas
leave `null` out for readability.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from mstar.http.speech.audio import CONTENT_TYPES
from mstar.http.media import AUDIO_FORMATS
from mstar.http.text.chat_audio import FORMATS as CHAT_AUDIO_FORMATS
from mstar.http.text.chat_audio import MODALITIES, STREAMED_FORMAT
from mstar.http.text.chat_messages import CHAT_ROLES, IMAGE_DETAILS
from mstar.http.fields import Fields
from mstar.http.text.protocol import COMPLETIONS_MAX_TOKENS, MAX_CHOICES, MAX_N, SERVICE_TIERS
from mstar.http.speech.protocol import DEFAULT_FORMAT, MAX_INPUT_CHARS, StreamFormat
from mstar.http.speech.protocol import SAMPLING_KEYS as SPEECH_SAMPLING_KEYS
from mstar.types import MAX_LOGPROBS, MAX_OUTPUT_PENALTY, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, SamplingParams

Schema = dict[str, Any]

# The list limits are `Fields` keyword defaults; read them rather than copy them.
MAX_STOPS: int = inspect.signature(Fields.stops).parameters["max_count"].default
MAX_STOP_TOKEN_IDS: int = inspect.signature(Fields.int_list).parameters["max_count"].default
MAX_SEED = 2**63 - 1  # any int64; `Fields.seed` folds it into the engine's [0, 2**63)
DEFAULTS = SamplingParams()
_SHIPPED = "the served model's generation config's (--generation-config), else"


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def unsupported(what: str) -> Schema:
    # The parsers refuse any truthy value; false (or leaving it out) is the only useful one.
    return {"description": f"{what} is not supported; only false or null is accepted", "enum": [False, None]}


def int_list(min_items: int = 0) -> Schema:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": min_items}


def sampling_properties() -> dict[str, Schema]:
    """`SamplingParams` by name (all but `max_tokens`), as `read_sampling` reads them. The five a served
    folder's generation config may set declare no `default`: a client generated from the document would send
    the API's as if asked for, over the model's."""
    return {
        "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                        "description": f"0 is greedy; left out: {_SHIPPED} {DEFAULTS.temperature}"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                  "description": f"left out: {_SHIPPED} {DEFAULTS.top_p}"},
        "top_k": {"type": "integer", "minimum": -1,
                  "description": f"0 or -1 disables top-k; left out: {_SHIPPED} {DEFAULTS.top_k}"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1,
                  "description": f"left out: {_SHIPPED} {DEFAULTS.min_p}"},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY,
                               "description": f"left out: {_SHIPPED} {DEFAULTS.repetition_penalty}"},
        "presence_penalty": {"type": "number", "minimum": -MAX_OUTPUT_PENALTY, "maximum": MAX_OUTPUT_PENALTY,
                             "default": DEFAULTS.presence_penalty,
                             "description": "subtracted from the logit of every id the request has generated"},
        "frequency_penalty": {"type": "number", "minimum": -MAX_OUTPUT_PENALTY, "maximum": MAX_OUTPUT_PENALTY,
                              "default": DEFAULTS.frequency_penalty,
                              "description": "subtracted from an id's logit once for each time the request "
                                             "generated it"},
        "seed": {"type": "integer", "minimum": -MAX_SEED - 1, "maximum": MAX_SEED,
                 "description": "makes the request's draws reproducible whatever it is batched with"},
        "stop": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS}],
                 "description": "a string, or an array of non-empty strings, that ends the generation"},
        "stop_token_ids": {**int_list(), "maxItems": MAX_STOP_TOKEN_IDS},
        "ignore_eos": {"type": "boolean", "default": DEFAULTS.ignore_eos},
        "skip_special_tokens": {"type": "boolean", "default": DEFAULTS.skip_special_tokens,
                                "description": "the text leaves special tokens out (vLLM's)"},
        "include_stop_str_in_output": {"type": "boolean", "default": DEFAULTS.include_stop_str_in_output,
                                       "description": "the text keeps the stop string that ended it (vLLM's)"},
        "min_tokens": {"type": "integer", "minimum": 0, "default": DEFAULTS.min_tokens,
                       "description": "EOS and stop_token_ids are not drawn before this many tokens, and a stop "
                                      "string counts only where it ends after them"},
    }


def logprobs_count(what: str) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
            "description": f"{what}: each sampled token's log probability and the given number of most likely "
                           "tokens', of the model's raw distribution (before penalty, temperature and filters)"}


def max_tokens(default: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "minimum": 1,
                      "description": "at most the context window less the prompt"}
    return schema if default is None else {**schema, "default": default}


def sampling_by() -> Schema:
    """mstar's `sampling_by`: the route checks its shape, the model the rest."""
    return {"type": "object",
            "additionalProperties": {"type": "object",
                                     # logprobs are asked with the route's own field: an answer shapes only those
                                     "properties": {"max_tokens": max_tokens(), **sampling_properties()},
                                     "additionalProperties": False},
            "examples": [{"llm": {"temperature": 0}}],
            "description": "mstar's: sampling per sampling key of the walk (a partition that samples; the root "
                           "partition's key applies on top of the request's own fields), `SamplingParams` fields "
                           "by name. The model checks it: a key its walk lacks is a 400 naming "
                           "`sampling_by.<key>`, a field unknown or out of range one naming "
                           "`sampling_by.<key>.<field>`"}


PRIORITY: Schema = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1, "default": 0,
                    "description": "mstar's (as vLLM's): lower is served first among requests waiting for a step; "
                                   "realtime sessions' responses ask for -1"}


def openai_common() -> dict[str, Schema]:
    """What `/v1/completions` and `/v1/chat/completions` share."""
    return {
        "model": {"type": "string", "description": "a served model's id; the only one if left out"},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "default": 1},
        "stream": {"type": "boolean", "default": False,
                   "description": "server-sent events (`data: {...}`, ending with `data: [DONE]`)"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean", "default": False},
                                          "continuous_usage_stats": {
                                              "type": "boolean", "default": False,
                                              "description": "vLLM's: with include_usage, the totals so far in "
                                                             "every chunk"},
                                          "include_obfuscation": {"enum": [False],
                                                                  "description": "OpenAI's event padding: not "
                                                                                 "served; only false is accepted"}},
                           "description": "only with `stream: true`"},
        "logit_bias": {"type": "object", "maxProperties": 0, "description": "not supported; only {} is accepted"},
        "user": {"type": "string"},
        "response_format": {"type": "object", "required": ["type"],
                            "properties": {"type": {"enum": ["text"]}}},
        **sampling_properties(),
        "sampling_by": sampling_by(),
        "priority": PRIORITY,
    }


def chat_extras() -> dict[str, Schema]:
    """Chat fields that ask for nothing this server lacks, and those refused."""
    return {
        "function_call": {"enum": ["none", "auto"], "description": "functions are not supported"},
        "parallel_tool_calls": {"type": "boolean", "description": "tools are not supported; accepted for clients "
                                                                  "that always send it"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                     "description": "accepted; nothing is stored"},
        "store": {"enum": [False, None], "description": "storing completions is not supported"},
        "service_tier": {"enum": list(SERVICE_TIERS), "description": "one tier serves every request"},
        "safety_identifier": {"type": "string"},
        "prompt_cache_key": {"type": "string"},
        **{key: unsupported(key) for key in ("prediction", "reasoning_effort", "verbosity", "web_search_options")},
    }


VOICE: Schema = {"oneOf": [{"type": "string", "pattern": r"\S"},
                           {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}],
                 "description": "a voice of the model (`/v1/models` lists them), by name or as `{\"id\": name}`"}

CHAT_AUDIO: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["voice", "format"],
    "properties": {
        "voice": VOICE,
        "format": {"enum": list(CHAT_AUDIO_FORMATS),
                   "description": f"of `message.audio.data`; a stream's pieces are `{STREAMED_FORMAT}` only "
                                  "(16-bit PCM, 24 kHz mono); flac, mp3 and opus need a soundfile with those "
                                  "codecs"},
    },
    "description": "a spoken answer (needs `modalities` with `audio`, and a model that speaks): the whole audio "
                   "in `message.audio`, or streamed in `delta.audio` pieces; no `logprobs` with it",
}

# `stream_options` needs `stream: true`.
STREAM_OPTIONS_NEED_STREAM: Schema = {
    "stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}}}

PROMPT: Schema = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "description": "token ids"},
        {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]},
         "description": "several prompts, each a string or token ids; one set of `n` choices each"},
    ],
    "examples": ["Once upon a time"],
}

COMPLETION_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["prompt"],
    "properties": {
        "prompt": PROMPT,
        "max_tokens": max_tokens(COMPLETIONS_MAX_TOKENS),
        "best_of": {"type": "integer", "minimum": 1, "description": "only equal to `n` is accepted"},
        "echo": unsupported("echo"),
        "logprobs": logprobs_count("logprobs"),
        "suffix": unsupported("suffix"),
        **openai_common(),
    },
    "dependentSchemas": STREAM_OPTIONS_NEED_STREAM,
    "description": f"prompts x n must be at most {MAX_CHOICES}",
}

TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"enum": ["text", "input_text"]}, "text": {"type": "string"}},
                     "description": "`input_text` (the Responses API's name) is read as `text`"}
REFUSAL_PART: Schema = {"type": "object", "required": ["type", "refusal"],
                        "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
                        "description": "an assistant message's only (an earlier answer replayed): read as its text"}
AUDIO_PART: Schema = {
    "type": "object",
    "required": ["type", "input_audio"],
    "properties": {
        "type": {"const": "input_audio"},
        "input_audio": {
            "type": "object",
            "required": ["data"],
            "additionalProperties": False,
            "properties": {
                "data": {"type": "string", "minLength": 1, "contentEncoding": "base64",
                         "description": "the audio file, base64; longer than the server's --max-audio-seconds "
                                        "(default 600) is refused"},
                "format": {"enum": list(AUDIO_FORMATS),
                           "description": "the file's format; the server reads it from the bytes either way"},
            },
        },
    },
    "description": "for a model whose `input_modalities` include `audio`",
}
IMAGE_URL: Schema = {"type": "string", "minLength": 1, "pattern": "^[Dd][Aa][Tt][Aa]:",
                     "description": "a data URL (data:image/png;base64,...) of a PNG, JPEG, WebP or GIF image; "
                                    "the server fetches no URLs; more pixels than its --max-image-pixels (default "
                                    "4096 x 4096) are refused"}
IMAGE_PART: Schema = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {"oneOf": [
            {"type": "object", "required": ["url"], "additionalProperties": False,
             "properties": {"url": IMAGE_URL,
                            "detail": {"enum": list(IMAGE_DETAILS), "description": "accepted; every image is "
                                                                                    "seen whole"}}},
            {**IMAGE_URL, "description": "the URL itself, as some clients send it"},
        ]},
    },
    "description": "for a model whose `input_modalities` include `image`",
}
CONTENT_PART: Schema = {"oneOf": [TEXT_PART, REFUSAL_PART, AUDIO_PART, IMAGE_PART]}

CHAT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES), "description": "`developer` is read as `system`"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": CONTENT_PART}],
                    "description": "required but for `assistant`; a message of text parts only has them joined "
                                   "with newlines; audio and image parts are decoded before the model reads them"},
        "audio": {"type": ["object", "null"], "required": ["id"], "additionalProperties": False,
                  "properties": {"id": {"type": "string", "minLength": 1}},
                  "description": "an assistant's only: an earlier spoken answer by its audio id, read as its "
                                 "transcript (kept an hour, on the server that made it)"},
        "tool_calls": unsupported("tool_calls"),
        "function_call": unsupported("function_call"),
    },
    # Only an assistant's message may leave out its content.
    "if": {"properties": {"role": {"const": "assistant"}}},
    "else": {"required": ["content"]},
}

CHAT_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": CHAT_MESSAGE, "minItems": 1,
                     "examples": [[{"role": "user", "content": "Hello!"}]]},
        "max_tokens": {**max_tokens(), "description": "at most the context window less the prompt; left out: the "
                                                      "served model's generation config's max_new_tokens, within "
                                                      "that room, else all of it"},
        "max_completion_tokens": {**max_tokens(), "description": "the newer name of `max_tokens`; wins over it"},
        "add_generation_prompt": {"type": "boolean", "default": True},
        "chat_template_kwargs": {"type": "object",
                                 "description": "vLLM's: more variables the model's chat template reads, such as "
                                                "Qwen's `enable_thinking`; not the ones the server sets (messages, "
                                                "add_generation_prompt, bos_token, eos_token, tools, documents)"},
        "tool_choice": {"enum": ["none", "auto"], "description": "tools are not supported"},
        "modalities": {"type": "array", "items": {"enum": list(MODALITIES)}, "minItems": 1, "uniqueItems": True,
                       "contains": {"const": "text"}, "default": ["text"],
                       "description": "`[\"text\", \"audio\"]` (with `audio`) asks for a spoken answer, its "
                                      "text as the audio's transcript"},
        "audio": CHAT_AUDIO,
        "logprobs": {"type": "boolean", "default": False,
                     "description": "each sampled token's log probability, of the model's raw distribution"},
        "top_logprobs": {**logprobs_count("top_logprobs"),
                         "description": "with `logprobs: true`: how many most likely tokens each position lists"},
        "tools": unsupported("tools"),
        "functions": unsupported("functions"),
        **chat_extras(),
        **openai_common(),
    },
    "dependentSchemas": {**STREAM_OPTIONS_NEED_STREAM, "top_logprobs": {
        "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
}

GENERATE_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    # Exactly one of text and input_ids.
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
    "properties": {
        "text": {"type": "string", "examples": ["Once upon a time"]},
        "input_ids": {**int_list(1), "items": {"type": "integer"}, "examples": [[1, 2, 3]],
                      "description": "token ids, skipping the tokenizer"},
        "model": {"type": "string"},
        "sampling_params": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"max_tokens": max_tokens(DEFAULTS.max_tokens), **sampling_properties(),
                           "logprobs": logprobs_count("logprobs")},
            "description": "`SamplingParams` by name; a speech walk takes the model's defaults for what is left out",
        },
        "stream": {"type": "boolean", "default": False, "description": "NDJSON, one object per chunk"},
        "voice": {"type": "string", "description": "speech models: the voice; needs `text`"},
        "walk": {"type": "string", "description": "one of the model's walks; its default if left out"},
        "sampling_by": sampling_by(),
        "priority": PRIORITY,
    },
    "dependentRequired": {"voice": ["text"]},
}

SPEECH_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["input"],
    "properties": {
        "input": {"type": "string", "minLength": 1, "maxLength": MAX_INPUT_CHARS, "pattern": r"\S",
                  "examples": ["Hello there."]},
        "model": {"type": "string"},
        "voice": {**VOICE, "description": "a voice of the model (its default if left out)"},
        "response_format": {"enum": sorted(CONTENT_TYPES), "default": DEFAULT_FORMAT,
                            "description": "flac, mp3 and opus need a soundfile with those codecs"},
        "stream_format": {"enum": list(typing.get_args(StreamFormat)), "default": "audio"},
        "stream": {"type": "boolean", "default": True,
                   "description": "mstar's: false gathers the whole audio first and answers with one file of "
                                  "known length (its header has the true sizes); needs stream_format 'audio'"},
        "speed": {"enum": [1.0], "description": "only 1.0 is supported"},
        "instructions": {"type": "string", "maxLength": 0, "description": "not supported"},
        "early_audio": {"type": "boolean", "default": False,
                        "description": "mstar's: the first audio sooner, its first frame decoded with less "
                                       "context (Orpheus: after 2 frames of tokens instead of 4; later frames "
                                       "are the same); 400 for a model without such a walk"},
        "max_tokens": max_tokens(),
        # No `default`: what is left out takes the model's (Orpheus: temperature 0.6, not 1.0), and a
        # client generated from the document would send the text routes' defaults as if asked for.
        **{k: {f: x for f, x in v.items() if f != "default" and not (f == "description" and _SHIPPED in x)}
           for k, v in sampling_properties().items() if k in SPEECH_SAMPLING_KEYS},
        "sampling_by": sampling_by(),
    },
    "description": "sampling fields left out take the model's defaults",
}

TOKENIZE_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    # Exactly one of prompt and messages.
    "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    "properties": {
        "prompt": {"type": "string", "examples": ["Hello!"], "description": "a text prompt, as /v1/completions "
                                                                               "tokenises it"},
        "messages": {**CHAT_REQUEST["properties"]["messages"],
                     "description": "a chat, as /v1/chat/completions templates and tokenises it (media included)"},
        "model": {"type": "string"},
        "add_generation_prompt": {"type": "boolean", "default": True, "description": "with `messages` only"},
        "chat_template_kwargs": {**CHAT_REQUEST["properties"]["chat_template_kwargs"]},
        "add_special_tokens": {"type": "boolean",
                               "description": "as the completion routes do: true for a prompt, false for messages "
                                              "(their template has the special tokens); another value is a 400"},
        "return_token_strs": {"type": "boolean", "default": False, "description": "each token's vocabulary string"},
    },
}

DETOKENIZE_REQUEST: Schema = {
    "type": "object",
    "additionalProperties": False,
    "required": ["tokens"],
    "properties": {"tokens": {**int_list(), "examples": [[1, 2, 3]]}, "model": {"type": "string"}},
}
