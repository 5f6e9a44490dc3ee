"""Text streamed into a running speech request (later NDJSON lines of
`/v1/audio/speech`, text added to a running realtime response) is checked as
the first input is: a line that is not `{"input": <1..4096 characters>}`, or
whose tokens would overflow the context, ends the request, and the client is
told: a JSON 400 naming the field before any audio, an `error` event on an
SSE stream, a raw audio body cut short (and the error logged)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from http_support import running_engine, serving, wait_until
from openai import AsyncOpenAI
from structlog.testing import capture_logs

from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

NDJSON = {"Content-Type": "application/x-ndjson"}
FIRST = {"model": "orpheus-tiny", "input": "the first sentence.", "voice": "tara", "response_format": "pcm",
         "max_tokens": 35, "ignore_eos": True, "seed": 3}
# under the 4096-character limit, but the byte tokenizer makes it longer than orpheus-tiny's 2048-token context
OVERFLOW = "x" * 3000


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speaker() -> AsyncIterator[tuple[Engine, str]]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield engine, url


async def _idle(engine: Engine) -> None:
    assert await wait_until(lambda: engine.num_running() == 0 and engine.pages_in_use() == 0)


@pytest.mark.parametrize("line, field, says", [
    (b"{oops", "body", "invalid JSON"),
    (b'["more"]', "body", "JSON object"),
    (b'{"text": "more"}', "text", "unknown field"),
    (b'{"input": "more", "voice": "leo"}', "voice", "unknown field"),
    (b"{}", "input", "required"),
    (b'{"input": 5}', "input", "string"),
    (b'{"input": "   "}', "input", "empty"),
    (orjson.dumps({"input": "y" * 100_000}), "input", "at most 4096 characters"),
    (orjson.dumps({"input": OVERFLOW}), "input", "context of 2048 tokens"),
    # past the body reader's line limit: the request ends, it does not wait on for input
    (orjson.dumps({"input": "z" * (4 << 20)}), "body", "could not be read"),
], ids=["invalid-json", "not-an-object", "unknown-field", "unknown-field-beside-input", "no-input",
        "input-not-a-string", "input-blank", "input-of-100000-characters", "input-past-the-context",
        "line-of-4-mib"])
async def test_a_bad_line_before_any_audio_is_a_400_naming_the_field(speaker, line: bytes, field: str,
                                                                      says: str) -> None:
    engine, url = speaker
    payload = orjson.dumps(FIRST) + b"\n" + line + b"\n" + orjson.dumps({"input": "never spoken"}) + b"\n"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", data=payload, headers=NDJSON) as r:
            answer = await r.json()
    assert r.status == 400, answer
    assert answer["error"]["param"] == field and says in answer["error"]["message"], answer
    assert "line 2" in answer["error"]["message"]
    await _idle(engine)


async def _first_line_then(heard: asyncio.Event, later: bytes) -> AsyncIterator[bytes]:
    yield orjson.dumps({**FIRST, "max_tokens": 200}) + b"\n"
    await asyncio.wait_for(heard.wait(), 60)  # audio is already on its way back
    yield later + b"\n"
    await asyncio.sleep(30)  # the body stays open: the refusal alone must end the answer


async def test_after_audio_an_sse_stream_ends_with_an_error_event_naming_the_field(speaker) -> None:
    engine, url = speaker
    heard = asyncio.Event()
    events: list[dict[str, Any]] = []
    body = _sse(_first_line_then(heard, orjson.dumps({"input": OVERFLOW})))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", data=body, headers=NDJSON) as r:
            assert r.status == 200
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    events.append(orjson.loads(block[len(b"data: "):]))
                    heard.set()
    assert events[0]["type"] == "speech.audio.delta"
    last = events[-1]
    assert last["type"] == "error", last
    assert last["error"]["param"] == "input" and "context" in last["error"]["message"]
    assert last["error"]["type"] == "invalid_request_error"
    assert not any(e["type"] == "speech.audio.done" for e in events)
    await _idle(engine)


async def _sse(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The same body with the first line asking for SSE."""
    first = True
    async for line in body:
        if first:
            line = orjson.dumps({**orjson.loads(line), "stream_format": "sse"}) + b"\n"
            first = False
        yield line


async def test_after_audio_an_audio_body_is_cut_short_and_the_error_logged(speaker) -> None:
    engine, url = speaker
    heard = asyncio.Event()
    received = bytearray()
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            body = _first_line_then(heard, b'{"input": "more", "speed": 2}')
            async with http.post(f"{url}/v1/audio/speech", data=body, headers=NDJSON) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for data in r.content.iter_any():
                        received += data
                        heard.set()
    assert received  # some audio went out before the cut
    refused = [e for e in logs if e.get("field") == "speed"]
    assert refused and "unknown field" in refused[0]["error"], logs
    await _idle(engine)


async def test_engine_append_refuses_a_piece_that_overflows_the_context(speaker) -> None:
    engine, _ = speaker
    request = GenerateRequest("append-overflow", "orpheus-tiny", {"text": "hello", "voice": "tara"},
                              SamplingParams(max_tokens=8, ignore_eos=True), more_input=True)
    stream = engine.submit(request)
    try:
        with pytest.raises(RequestError) as caught:
            engine.append(stream.request_id, {"text": OVERFLOW})
        assert caught.value.field == "input" and "context" in caught.value.message
        assert stream.request_id in engine._states and engine._states[stream.request_id].num_prompt_tokens < 100
        assert engine.append(stream.request_id, {"text": "a short one"}) > 0  # the request still takes input
    finally:
        await stream.aclose()
    await _idle(engine)


async def test_realtime_text_past_the_context_is_an_error_event(speaker) -> None:
    engine, url = speaker
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    async with client.realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 35,
                                           "mstar": {"input_linger_ms": 3000, "seed": 7}})
        await conn.conversation.item.create(item=_user("first part"))
        await conn.response.create()
        async for ev in conn:
            if ev.type == "response.output_audio.delta":
                break
        await conn.conversation.item.create(item=_user(OVERFLOW))
        async for ev in conn:
            if ev.type == "error":
                assert ev.error.param == "item.content" and "context" in ev.error.message
                break
            assert ev.type != "response.done", "the response ended without telling of the refused text"
        await conn.response.cancel()
        async for ev in conn:
            if ev.type == "response.done":
                break
    await _idle(engine)


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def test_a_first_input_leaving_less_than_a_window_is_refused_not_silent(speaker) -> None:
    """A text whose prompt leaves the context fewer tokens than the model's
    shortest spoken answer (`min_turn_tokens`: two frames) is a 400 naming
    `input`, as a later line's is, not a 200 with no audio; one that leaves
    exactly that many is spoken."""
    engine, url = speaker
    need, context = engine.model.min_turn_tokens, engine.model.max_model_len

    def room(n: int) -> int:
        request = GenerateRequest("probe", "orpheus-tiny", {"text": "a" * n, "voice": "tara"},
                                  SamplingParams(max_tokens=None))
        return context - engine.model.prepare(request).num_prompt_tokens

    short = 2000 + room(2000) - need + 1  # the byte tokenizer: a token a character
    assert room(short - 1) == need  # (its prepare refuses `short` itself, as the route below is to)
    body = {"model": "orpheus-tiny", "voice": "tara", "response_format": "pcm", "ignore_eos": True, "seed": 3}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", json={**body, "input": "a" * short}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["param"] == "input" and error["code"] == "context_length_exceeded"
            assert f"fewer than the {need}" in error["message"]
        async with http.post(f"{url}/v1/audio/speech", json={**body, "input": "a" * (short - 1)}) as r:
            assert r.status == 200 and len(await r.read()) > 0
    await _idle(engine)


async def test_a_realtime_text_leaving_less_than_a_window_is_an_error_event(speaker) -> None:
    """The same on /v1/realtime: the response is refused with an `error` event naming its input, and the
    session answers the next text."""
    engine, url = speaker
    need, context = engine.model.min_turn_tokens, engine.model.max_model_len
    request = GenerateRequest("probe", "orpheus-tiny", {"text": "a" * 1000, "voice": "tara"},
                              SamplingParams(max_tokens=None))
    short = 1000 + context - engine.model.prepare(request).num_prompt_tokens - need + 1
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    async with client.realtime.connect(model="orpheus-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 35, "mstar": {"seed": 7}})
        await conn.conversation.item.create(item=_user("a" * short))
        await conn.response.create()
        long_item = None
        async for ev in conn:
            assert ev.type != "response.created", "a response began that has no room to answer"
            if ev.type == "conversation.item.done":
                long_item = ev.item.id
            if ev.type == "error":
                assert ev.error.code == "context_length_exceeded" and f"fewer than the {need}" in ev.error.message
                break
        assert long_item is not None
        await conn.conversation.item.delete(item_id=long_item)
        await conn.conversation.item.create(item=_user("hello there"))
        await conn.response.create()
        async for ev in conn:
            if ev.type == "response.done":
                assert ev.response.usage.output_tokens > 0
                break
    await _idle(engine)
