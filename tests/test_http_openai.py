"""The official `openai` client against the server and the real tiny-llama
engine: models, completions and chat, streaming and not, and its errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from http_support import MODEL, serving

from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(engine: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving(engine) as base:
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        yield api
        await api.close()


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [MODEL]


async def test_completion(client: openai.AsyncOpenAI, engine: Engine) -> None:
    answer = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, **GREEDY)
    assert answer.object == "text_completion" and answer.model == MODEL
    [choice] = answer.choices
    assert choice.finish_reason == "length" and choice.index == 0
    prompt = len(engine.tokenizer(MODEL).encode("Once upon"))
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        prompt, 5, prompt + 5)


async def test_completion_stream(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, **GREEDY)
    stream = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_completion_stream_with_continuous_usage(client: openai.AsyncOpenAI) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries the totals so
    far, counting up to the whole answer's; without it, `usage: null`."""
    whole = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, **GREEDY)
    for continuous in (True, False):
        stream = await client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=6, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": continuous}, **GREEDY)
        chunks = [c async for c in stream]
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        counts = [c.usage.completion_tokens if c.usage else None for c in chunks[:-1]]
        if continuous:
            assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
            assert counts == sorted(counts) and 0 < counts[0] and counts[-1] == 6
        else:
            assert counts == [None] * len(counts)


async def test_chat_template_kwargs_reach_the_template(client: openai.AsyncOpenAI, engine: Engine) -> None:
    tok = engine.tokenizer(MODEL)
    template = tok.chat_template
    tok.chat_template = "{% if enable_thinking is defined and not enable_thinking %}no thinking: {% endif %}hi"
    tok._compiled = None
    try:
        messages = [{"role": "user", "content": "hello"}]
        counts = []
        for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                          temperature=0, extra_body=kwargs)
            counts.append(answer.usage.prompt_tokens)
        assert counts == [len(tok.encode(text, add_special_tokens=False)) for text in ("hi", "no thinking: hi")]
    finally:
        tok.chat_template, tok._compiled = template, None


async def test_chat(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello"}],
        max_completion_tokens=4, n=2, seed=5, **GREEDY)
    assert answer.object == "chat.completion" and len(answer.choices) == 2
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in answer.choices)
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    # OpenAI's message carries these (null and empty here); strict clients read them
    assert all(c.message.refusal is None and c.message.annotations == [] for c in answer.choices)
    assert "refusal" in answer.choices[0].message.model_fields_set


async def test_chat_stream(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "hello"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True,
                                                  **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_errors_reach_the_client(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert "no-such-model" in str(missing.value)


async def test_presence_and_frequency_penalties_reach_the_sampler(client: openai.AsyncOpenAI,
                                                                  engine: Engine) -> None:
    """The official client's `presence_penalty` and `frequency_penalty`: the
    penalised greedy answer is the engine's own with those params, and not
    the plain greedy one."""
    async def text(**fields) -> str:
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "say it again and again"}], max_tokens=24,
            **GREEDY, **fields)
        return answer.choices[0].message.content or ""

    plain = await text()
    penalised = await text(presence_penalty=1.5, frequency_penalty=2.0)
    assert penalised != plain
    prompt = engine.model.prepare(GenerateRequest("p", MODEL, {"messages": [
        {"role": "user", "content": "say it again and again"}]})).values["prompt_ids"].tolist()
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=2.0)
    direct: list[int] = []
    async for chunk in engine.submit(GenerateRequest("direct", MODEL, {"prompt_ids": prompt}, sp)):
        direct += chunk.token_ids
    assert penalised == engine.tokenizer(MODEL).decode(direct, skip_special_tokens=True)
