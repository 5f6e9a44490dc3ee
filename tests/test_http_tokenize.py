"""`/tokenize` and `/detokenize` (vLLM's): a text prompt's ids are the ones
`/v1/completions` starts from, a chat's (audio included) the ones
`/v1/chat/completions` starts from, as their usage counts them; ids go back
to their text; every misuse is a 400 naming its field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from http_support import MODEL, running_engine, serving
from test_http_chat_media import asking, audio_part, clip, encoded

from mstar.engine.engine import Engine

on_module_loop = pytest.mark.asyncio(loop_scope="module")
OMNI = "qwen3-omni-tiny"
CONTEXT = 256


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def llama() -> AsyncIterator[tuple[Engine, aiohttp.ClientSession]]:
    async with running_engine(MODEL, CONTEXT) as engine, serving(engine) as url:
        async with aiohttp.ClientSession(url) as http:
            yield engine, http


async def post(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(path, json=body) as r:
        return r.status, await r.json()


@on_module_loop
async def test_a_prompts_ids_are_the_ones_its_completion_starts_from(llama: tuple[Engine, aiohttp.ClientSession]) \
        -> None:
    engine, http = llama
    status, out = await post(http, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert status == 200, out
    tokenizer = engine.tokenizer(MODEL)
    assert out["tokens"] == tokenizer.encode("Hello there") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == CONTEXT
    assert out["token_strs"] == [tokenizer.id_to_token(t) for t in out["tokens"]]
    _, done = await post(http, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == out["count"]


@on_module_loop
async def test_a_chats_ids_are_its_templated_prompt(llama: tuple[Engine, aiohttp.ClientSession]) -> None:
    engine, http = llama
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, out = await post(http, "/tokenize", {"messages": messages})
    tokenizer = engine.tokenizer(MODEL)
    assert out["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    _, bare = await post(http, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["count"] < out["count"] and out["tokens"][:bare["count"]] == bare["tokens"]
    _, done = await post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == out["count"]


@on_module_loop
async def test_ids_go_back_to_their_text(llama: tuple[Engine, aiohttp.ClientSession]) -> None:
    engine, http = llama
    text = "Grüße, world!"
    ids = engine.tokenizer(MODEL).encode(text, add_special_tokens=False)
    status, out = await post(http, "/detokenize", {"model": MODEL, "tokens": ids})
    assert (status, out) == (200, {"prompt": text})
    _, whole = await post(http, "/tokenize", {"prompt": text})
    _, back = await post(http, "/detokenize", {"tokens": whole["tokens"]})
    assert back["prompt"].endswith(text) and back["prompt"] != text  # the BOS is spoken for: specials are kept


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "either"),
    ("/tokenize", {}, "prompt", "either"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens", "must be true"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True},
     "add_special_tokens", "must be false"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "messages"),
    ("/tokenize", {"prompt": "a", "temperature": 1}, "temperature", "unknown field"),
    ("/tokenize", {"prompt": "x" * (CONTEXT + 10)}, "prompt", "context"),
    ("/detokenize", {"tokens": [1, 2, 2**32]}, "tokens[2]", "largest id"),
    ("/detokenize", {"tokens": [2**63 - 1]}, "tokens[0]", "largest id"),
    ("/detokenize", {"tokens": [1, -3]}, "tokens", "at least 0"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "array of integers"),
    ("/detokenize", {}, "tokens", "required"),
])
@on_module_loop
async def test_misuse_is_a_400_naming_the_field(llama: tuple[Engine, aiohttp.ClientSession], path: str,
                                                 body: dict[str, Any], param: str, says: str) -> None:
    status, out = await post(llama[1], path, body)
    assert status == 400 and out["error"]["param"] == param and says in out["error"]["message"], out


@on_module_loop
async def test_an_unknown_model_is_a_404(llama: tuple[Engine, aiohttp.ClientSession]) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, out = await post(llama[1], path, {**body, "model": "nope"})
        assert status == 404 and out["error"]["code"] == "model_not_found"


@pytest.mark.asyncio
async def test_a_chat_with_audio_counts_its_audio_tokens() -> None:
    async with running_engine(OMNI, 512) as engine, serving(engine) as url, aiohttp.ClientSession(url) as http:
        messages = asking(audio_part(encoded(clip(1.0), "wav")))
        status, out = await post(http, "/tokenize", {"messages": messages})
        assert status == 200, out
        _, text_only = await post(http, "/tokenize", {"messages": asking()})
        assert out["count"] > text_only["count"] + 10  # 1 s of audio: ~13 tokens
        _, done = await post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert done["usage"]["prompt_tokens"] == out["count"]
        # they go back: the model's own special and audio ids, which its tiny tokenizer cannot spell, add no text
        status, back = await post(http, "/detokenize", {"tokens": text_only["tokens"]})
        assert status == 200 and "what is this?" in back["prompt"], back
