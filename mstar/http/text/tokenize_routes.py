"""vLLM's `/tokenize` and `/detokenize`. A text `prompt`, or chat `messages`
(media included), goes in; out come the token ids the model would start
from, prepared exactly as `/v1/completions` and `/v1/chat/completions` would
prepare them (the chat template, BOS, media placeholders), their count and
the served context. Token ids go in to `/detokenize`; their text comes out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mstar.errors import RequestError
from mstar.http.fields import Fields
from mstar.http.ids import uuid4_hex
from mstar.http.keys import ENGINE, MEDIA, MEDIA_LIMITS, TARGETS, TRANSCRIPTS
from mstar.http.responses import json_response
from mstar.http.submission import Target, off_loop
from mstar.http.text.chat_media import chat_inputs
from mstar.http.text.chat_messages import ChatMessage, read_messages
from mstar.http.text.openai_routes import text_walk
from mstar.http.text.protocol import parse_json_object
from mstar.types import MAX_TOKEN_ID, GenerateRequest, SamplingParams

TOKENIZE_KEYS = frozenset({"model", "prompt", "messages", "add_generation_prompt", "chat_template_kwargs",
                           "return_token_strs", "add_special_tokens"})
DETOKENIZE_KEYS = frozenset({"model", "tokens"})
MAX_DETOKENIZE = 1 << 20  # ids in one body: more than any served context


@dataclass(frozen=True)
class TokenizeBody:
    """Exactly one of `prompt` and `messages`."""

    model: str | None
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_strs: bool = False


def parse_tokenize(body: bytes) -> TokenizeBody:
    f = Fields(parse_json_object(body))
    f.refuse_unknown(TOKENIZE_KEYS)
    if f.has("prompt") == f.has("messages"):
        raise f.error("prompt", "give either 'prompt' (text) or 'messages' (a chat), not both or neither")
    chat = f.has("messages")
    # the routes this one mirrors add the model's special tokens to a text prompt and none to a chat's template
    if f.boolean("add_special_tokens", not chat) != (not chat):
        raise f.error("add_special_tokens", f"must be {str(not chat).lower()} here: a {'chat' if chat else 'text'} "
                                            "prompt is tokenised as its completion route tokenises it")
    if not chat and (f.has("add_generation_prompt") or f.has("chat_template_kwargs")):
        raise f.error("add_generation_prompt" if f.has("add_generation_prompt") else "chat_template_kwargs",
                      "applies to 'messages' only")
    return TokenizeBody(model=f.string("model"), prompt=f.string("prompt"),
                        messages=read_messages(f) if chat else None,
                        add_generation_prompt=f.boolean("add_generation_prompt", True),
                        template_kwargs=f.mapping("chat_template_kwargs"),
                        return_token_strs=f.boolean("return_token_strs"))


async def tokenize(request: web.Request) -> web.Response:
    raw = await request.read()
    body = await off_loop(len(raw), parse_tokenize, raw)
    engine = request.app[ENGINE]
    target = request.app[TARGETS].resolve(body.model)
    walk = text_walk(target)
    if body.messages is not None:
        values, _ = await chat_inputs(request.app[MEDIA], request.app[MEDIA_LIMITS],
                                      request.app[TRANSCRIPTS].resolve(body.messages), target.name,
                                      target.input_modalities, body.add_generation_prompt, body.template_kwargs)
    else:
        values = {"prompt": body.prompt}
    # max_tokens None: refused only where the prompt leaves the context no room for one token
    gen = GenerateRequest(f"tokenize-{uuid4_hex()}", target.name, values, SamplingParams(max_tokens=None),
                          walk=walk)
    prepared = await engine.prepare(gen)
    ids = prepared.values.get("prompt_ids")
    if ids is None:
        raise RequestError(f"model '{target.name}' does not start from token ids", field="model")
    tokens = ids.tolist()
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": target.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = [_tokenizer(target).id_to_token(t) for t in tokens]
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    raw = await request.read()
    f = Fields(await off_loop(len(raw), parse_json_object, raw))
    f.refuse_unknown(DETOKENIZE_KEYS)
    if not f.has("tokens"):
        raise f.error("tokens", "is required: an array of token ids")
    tokens = f.int_list("tokens", max_count=MAX_DETOKENIZE)
    tokenizer = _tokenizer(request.app[TARGETS].resolve(f.string("model")))
    return json_response({"prompt": await off_loop(len(raw), _text_of, tokenizer, tokens)})


def _text_of(tokenizer: Any, tokens: tuple[int, ...]) -> str:
    """Their text; an id the tokenizer cannot spell (one of a model's own
    special ids beyond its tokenizer's, as the built-in tiny models have)
    adds none, as a Hugging Face tokenizer's decode (and vLLM's) does."""
    for i, t in enumerate(tokens):
        if t > MAX_TOKEN_ID:  # past int32 the tokenizer's own lookup overflows
            raise RequestError(f"token id {t} is past the largest id a model has ({MAX_TOKEN_ID})",
                               field=f"tokens[{i}]")
    return tokenizer.decode(list(tokens), skip_special_tokens=False)


def _tokenizer(target: Target) -> Any:
    if target.tokenizer is None:
        raise RequestError(f"model '{target.name}' has no tokenizer", field="model")
    return target.tokenizer
