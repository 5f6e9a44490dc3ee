"""The HTTP routes against the real tiny-llama engine on a loopback port:
answers, streams, token counts and finish reasons."""

from __future__ import annotations


import aiohttp
import pytest
from http_support import MODEL, read_ndjson, read_sse, wait_until

from mstar.engine.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")


def greedy(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def test_health_and_request_id(http: aiohttp.ClientSession) -> None:
    async with http.get("/health", headers={"X-Request-Id": "probe-1"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "probe-1"
        body = await r.json()
    assert body["status"] == "ok" and body["model"] == MODEL and body["devices"]
    async with http.get("/health") as r:
        assert len(r.headers["X-Request-Id"]) >= 16  # one is made up when the client sends none


async def test_models_list(http: aiohttp.ClientSession) -> None:
    async with http.get("/v1/models") as r:
        body = await r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    assert isinstance(card["created"], int) and card["owned_by"]
    assert card["root"] == MODEL and card["parent"] is None  # vLLM's fields
    assert card["voices"] == []  # a text model; a speech model lists its voices (test_http_speech)


async def test_completions_max_tokens_null_fills_the_context(http: aiohttp.ClientSession) -> None:
    """vLLM's reading: an explicit null leaves all the room the prompt leaves; left out it is OpenAI's 16."""
    async with http.get("/v1/models") as r:
        room = (await r.json())["data"][0]["max_model_len"]
    request = {"prompt": [5] * (room - 3), "max_tokens": None, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/completions", json=request) as r:
        assert r.status == 200, await r.text()
        body = await r.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    async with http.post("/v1/completions", json={"prompt": [5, 6], "temperature": 0, "ignore_eos": True}) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 16


async def test_generate_counts_and_text(http: aiohttp.ClientSession, engine: Engine) -> None:
    tok = engine.tokenizer(MODEL)
    async with http.post("/generate", json={"text": "hello", "sampling_params": greedy(6)}) as r:
        assert r.status == 200
        body = await r.json()
    assert len(body["token_ids"]) == 6 and body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(tok.encode("hello")), "completion_tokens": 6,
                             "total_tokens": len(tok.encode("hello")) + 6}
    assert body["text"] == tok.decode(body["token_ids"])
    # The same prompt as token ids gives the same greedy tokens.
    ids = tok.encode("hello")
    async with http.post("/generate", json={"input_ids": ids, "sampling_params": greedy(6)}) as r:
        assert (await r.json())["token_ids"] == body["token_ids"]


async def test_generate_stream_matches_the_answer(http: aiohttp.ClientSession) -> None:
    request = {"text": "stream me", "sampling_params": greedy(5)}
    async with http.post("/generate", json=request) as r:
        whole = await r.json()
    async with http.post("/generate", json={**request, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "application/x-ndjson"
        lines = await read_ndjson(r)
    assert [line["finished"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"] == whole["usage"]
    assert [t for line in lines for t in line["token_ids"]] == whole["token_ids"]
    assert "".join(line["text"] for line in lines) == whole["text"]


async def test_stop_string_cuts_the_text(http: aiohttp.ClientSession) -> None:
    async with http.post("/generate", json={"text": "hello", "sampling_params": greedy(12)}) as r:
        text = (await r.json())["text"]
    stop = next((c for c in text if c.isprintable() and c.strip()), None)
    if stop is None:
        pytest.skip(f"the random model wrote nothing printable: {text!r}")
    async with http.post("/generate", json={"text": "hello", "sampling_params": greedy(12, stop=[stop])}) as r:
        body = await r.json()
    assert body["finish_reason"] == "stop" and body["text"] == text[: text.index(stop)]


async def test_completions_many_prompts_and_samples(http: aiohttp.ClientSession, engine: Engine) -> None:
    tok = engine.tokenizer(MODEL)
    prompts = ["one", "two three"]
    async with http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2, "seed": 3,
                                                  "max_tokens": 4, "ignore_eos": True}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}


async def test_completions_seed_is_reproducible(http: aiohttp.ClientSession) -> None:
    request = {"prompt": "seeded", "n": 2, "seed": 11, "max_tokens": 8, "ignore_eos": True}
    answers = []
    for _ in range(2):
        async with http.post("/v1/completions", json=request) as r:
            answers.append([c["text"] for c in (await r.json())["choices"]])
    assert answers[0] == answers[1]


async def test_a_prompt_is_tokenised_once_for_all_its_samples(http: aiohttp.ClientSession, engine: Engine,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tok = engine.tokenizer(MODEL)
    calls: list[str] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **k: calls.append(text) or real(text, *a, **k))
    sampled = {"n": 3, "seed": 11, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    async with http.post("/v1/completions", json={"prompt": ["one", "two three"], **sampled}) as r:
        assert r.status == 200
        texts = [c["text"] for c in sorted((await r.json())["choices"], key=lambda c: c["index"])]
    assert sorted(calls) == ["one", "two three"]
    async with http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       **sampled}) as r:
        assert r.status == 200 and len((await r.json())["choices"]) == 3
    assert len(calls) == 3  # the chat's template, rendered and tokenised once
    # sample j of a prompt draws as that prompt alone with seed + j
    for j in range(3):
        async with http.post("/v1/completions", json={"prompt": "two three", **sampled, "n": 1,
                                                      "seed": 11 + j}) as r:
            assert (await r.json())["choices"][0]["text"] == texts[3 + j]
    assert len(set(texts[3:])) == 3


async def test_completions_stream(http: aiohttp.ClientSession) -> None:
    request = {"prompt": "abc", **greedy(5)}
    async with http.post("/v1/completions", json=request) as r:
        whole = await r.json()
    async with http.post("/v1/completions", json={**request, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] and c["usage"] is None
               for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


async def test_chat(http: aiohttp.ClientSession, engine: Engine) -> None:
    tok = engine.tokenizer(MODEL)
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]
    async with http.post("/v1/chat/completions", json={"messages": messages, **greedy(4)}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt = len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4}


async def test_chat_stream(http: aiohttp.ClientSession) -> None:
    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}],
               "max_completion_tokens": 3, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/chat/completions", json=request) as r:
        whole = await r.json()
    async with http.post("/v1/chat/completions", json={**request, "stream": True}) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_without_a_limit_runs_past_the_completions_default(http: aiohttp.ClientSession,
                                                                     engine: Engine) -> None:
    """Chat's default limit is the rest of the context, not 16 tokens: read
    past 16 tokens, then hang up (which aborts the rest)."""
    request = {"messages": [{"role": "user", "content": "go"}], "stream": True, "ignore_eos": True}
    async with http.post("/v1/chat/completions", json=request) as r:
        assert r.status == 200
        events = 0
        while events < 1 + 20:  # the role event, then 20 tokens
            line = await r.content.readline()
            assert line and b'"finish_reason":"length"' not in line
            events += line.startswith(b"data: ")
    assert await wait_until(lambda: engine.health()["requests_running"] == 0)


async def test_empty_prompt_is_just_the_special_tokens(http: aiohttp.ClientSession, engine: Engine) -> None:
    async with http.post("/v1/completions", json={"prompt": "", **greedy(2)}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["usage"]["prompt_tokens"] == len(engine.tokenizer(MODEL).encode(""))


async def test_stop_reason_names_what_stopped_a_choice(http: aiohttp.ClientSession) -> None:
    """vLLM's `stop_reason`: the stop string or the `stop_token_ids` id that ended a choice, null when the
    length (or EOS) ended it; in a stream, null until the choice's last chunk."""
    async with http.post("/generate", json={"text": "hello", "sampling_params": greedy(12)}) as r:
        whole = await r.json()
    text, ids = whole["text"], whole["token_ids"]
    stop = next((c for c in text if c.isprintable() and c.strip()), None)
    if stop is None:
        pytest.skip(f"the random model wrote nothing printable: {text!r}")
    base = {"model": MODEL, "prompt": "hello", **greedy(12)}
    async with http.post("/v1/completions", json={**base, "stop": ["never-written", stop]}) as r:
        [choice] = (await r.json())["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    async with http.post("/v1/completions", json={**base, "stop_token_ids": [ids[3]]}) as r:
        [choice] = (await r.json())["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ids[3]
    async with http.post("/v1/completions", json=base) as r:
        [choice] = (await r.json())["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    async with http.post("/v1/completions", json={**base, "stop": [stop], "stream": True}) as r:
        events = await read_sse(r)
    pieces = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert [p["stop_reason"] for p in pieces] == [None] * (len(pieces) - 1) + [stop]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **greedy(12),
            "stop_token_ids": [ids[3]]}
    async with http.post("/v1/chat/completions", json=chat) as r:
        [choice] = (await r.json())["choices"]
    # the chat's prompt differs, so its answer may end otherwise: stop_reason says which way
    assert (choice["finish_reason"], choice["stop_reason"]) in (("stop", ids[3]), ("length", None))
