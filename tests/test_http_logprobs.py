"""Logprobs over HTTP on the tiny-llama engine: the legacy completions shape
and chat's `content` entries, streamed and not (a stream's pieces add up to
the plain answer), the native route's ids, what is refused, and the official
`openai` client reading them."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from http_support import MODEL, read_ndjson, read_sse, running_engine, serving

from mstar.engine.engine import Engine
from mstar.types import MAX_LOGPROBS

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 6}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "Hi there"}]}


async def _post(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(path, json=body) as r:
        answer = await r.json()
        assert r.status == 200, answer
        return answer


async def _stream(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post(path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1] if e["choices"]]


async def test_completion_logprobs_are_the_native_ones_by_token_string(http: aiohttp.ClientSession,
                                                                      engine: Engine) -> None:
    answer = await _post(http, "/v1/completions", {**GREEDY, "prompt": "Once upon", "logprobs": 3})
    [choice] = answer["choices"]
    lp = choice["logprobs"]
    native = await _post(http, "/generate", {"text": "Once upon", "sampling_params": {
        "temperature": 0, "ignore_eos": True, "max_tokens": 6, "logprobs": 3}})
    ids = native["token_ids"]
    assert len(ids) == len(native["logprobs"]) == answer["usage"]["completion_tokens"] == 6
    tok = engine.tokenizer(MODEL)
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in native["logprobs"]], abs=1e-5)
    # offsets index the text: in order, within it, and at each whole token's own string
    offsets, text = lp["text_offset"], choice["text"]
    assert offsets == sorted(offsets) and all(0 <= o < len(text) for o in offsets), (offsets, text)
    assert all(text[o:].startswith(t) for o, t in zip(offsets, lp["tokens"]) if "\ufffd" not in t)
    for token, logprob, top, entry in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], native["logprobs"]):
        # keyed by token string: ids whose strings are equal (byte tokens reading U+FFFD) share a key
        assert set(top) == {token} | {tok.decode([t["token_id"]], skip_special_tokens=False)
                                      for t in entry["top_logprobs"]}
        assert logprob <= 0 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the sampled token is the most likely
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token_id"] == entry["token_id"]
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)
    # without logprobs nothing is computed or sent
    plain = await _post(http, "/v1/completions", {**GREEDY, "prompt": "Once upon"})
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == choice["text"]


async def test_completion_stream_pieces_add_up_to_the_answer(http: aiohttp.ClientSession) -> None:
    body = {**GREEDY, "prompt": "Once upon", "logprobs": 2, "n": 2, "seed": 5, "temperature": 0.9}
    whole = await _post(http, "/v1/completions", body)
    pieces = await _stream(http, "/v1/completions", body)
    for index in (0, 1):
        mine = [p["logprobs"] for p in pieces if p["index"] == index and p["logprobs"] is not None]
        expected = whole["choices"][index]["logprobs"]
        def joined(key: str) -> list[Any]:
            return [x for m in mine for x in m[key]]

        assert joined("tokens") == expected["tokens"] and joined("text_offset") == expected["text_offset"]
        assert joined("token_logprobs") == pytest.approx(expected["token_logprobs"], abs=1e-5)
        for got, want in zip(joined("top_logprobs"), expected["top_logprobs"], strict=True):
            assert got == pytest.approx(want, abs=1e-5)


async def test_chat_logprobs_streamed_and_not(http: aiohttp.ClientSession) -> None:
    whole = await _post(http, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    text = whole["choices"][0]["message"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="replace") == text
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        # a whole character's token is its UTF-8; a byte of one (U+FFFD on its own) is that byte
        assert e["bytes"] == list(e["token"].encode("utf-8")) if e["token"] != "\ufffd" else \
            len(e["bytes"]) == 1 and e["bytes"][0] >= 0x80
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0] == {k: e[k] for k in ("token", "logprob", "bytes")}
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    pieces = await _stream(http, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    streamed = [e for p in pieces if p["logprobs"] is not None for e in p["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    # logprobs alone: the sampled tokens, no alternatives
    alone = await _post(http, "/v1/chat/completions", {**CHAT, "logprobs": True})
    assert [e["top_logprobs"] for e in alone["choices"][0]["logprobs"]["content"]] == [[]] * len(content)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ("/generate", {"text": "x", "sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
])
async def test_bad_logprobs_are_refused_naming_the_field(http: aiohttp.ClientSession, path: str,
                                                        body: dict[str, Any], field: str) -> None:
    async with http.post(path, json=body) as r:
        answer = await r.json()
    assert r.status == 400 and answer["error"]["param"] == field, answer


async def test_native_stream_lines_carry_their_tokens_logprobs(http: aiohttp.ClientSession) -> None:
    async with http.post("/generate", json={"text": "Hello", "stream": True, "sampling_params": {
            "temperature": 0, "ignore_eos": True, "max_tokens": 4, "logprobs": 1}}) as r:
        lines = await read_ndjson(r)
    with_tokens = [line for line in lines if line["token_ids"]]
    assert len(with_tokens) == 4
    for line in with_tokens:
        assert [e["token_id"] for e in line["logprobs"]] == line["token_ids"]
        assert [t["token_id"] for t in line["logprobs"][0]["top_logprobs"]] == line["token_ids"]


async def test_the_openai_client_reads_them(server: str) -> None:
    api = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        extra = {"extra_body": {"ignore_eos": True}}
        done = await api.completions.create(model=MODEL, prompt="Once", max_tokens=4, temperature=0, logprobs=2,
                                            **extra)
        lp = done.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
        assert lp.top_logprobs is not None and all(lp.tokens[i] in lp.top_logprobs[i] for i in range(4))
        chat = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                 **extra)
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 4
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
        stream = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                   stream=True, **extra)
        streamed = [c for chunk in [x async for x in stream] for ch in chunk.choices
                    if ch.logprobs is not None and ch.logprobs.content for c in ch.logprobs.content]
        assert [c.token for c in streamed] == [c.token for c in content]
        assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    finally:
        await api.close()


async def test_a_speech_walk_refuses_logprobs_naming_the_field() -> None:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url, aiohttp.ClientSession() as http:
        body = {"text": "hi", "voice": "tara", "sampling_params": {"max_tokens": 14, "logprobs": 2}}
        async with http.post(url + "/generate", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "sampling_params.logprobs"
        assert engine.num_running() == 0
