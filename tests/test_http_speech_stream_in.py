"""Text streamed into `POST /v1/audio/speech` (an NDJSON body) while the audio
streams out: a line sent after the first audio arrived is spoken in the same
request, and the end of the body ends it."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import pytest_asyncio
from http_support import running_engine, serving, wait_until

from mstar.engine.engine import Engine
from mstar.types import GenerateRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

TURN_BYTES = 4 * 2048 * 2  # a 35-token turn plays four frames of PCM16
FIRST = {"model": "orpheus-tiny", "input": "the first sentence.", "voice": "tara", "response_format": "pcm",
         "stream_format": "sse", "max_tokens": 35, "ignore_eos": True, "seed": 3}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speaker() -> AsyncIterator[tuple[Engine, str]]:
    async with running_engine("orpheus-tiny") as engine, serving(engine) as url:
        yield engine, url


async def _events(response: aiohttp.ClientResponse, heard: asyncio.Event) -> list[dict]:
    events, buf = [], b""
    async for data in response.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            events.append(orjson.loads(block[len(b"data: "):]))
            if events[-1]["type"] == "speech.audio.delta":
                heard.set()
    return events


async def test_lines_sent_while_it_speaks_join_the_request(speaker) -> None:
    engine, url = speaker
    heard = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield orjson.dumps(FIRST) + b"\n"
        await asyncio.wait_for(heard.wait(), 60)  # the audio is already streaming back
        yield orjson.dumps({"input": "and a second one."}) + b"\n"

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", data=body(),
                             headers={"Content-Type": "application/x-ndjson"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = await _events(r, heard)
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    # the second turn adds whole frames (random weights write a few non-audio ids, so not always four)
    assert TURN_BYTES < len(audio) <= 2 * TURN_BYTES and len(audio) % 4096 == 0
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == 2 * 35
    first = GenerateRequest("p", "orpheus-tiny", {"text": FIRST["input"], "voice": "tara"})
    p1 = len(engine.model.prepare(first).values["prompt_ids"])
    p2 = engine.model.prepare_more(first, {"text": "and a second one."}).num_tokens
    assert done["usage"]["input_tokens"] == p1 + p2  # the usage counts the text streamed in too
    assert engine.pages_in_use() == 0 and engine.num_running() == 0


async def test_a_bad_line_ends_the_request_with_a_400_naming_it(speaker) -> None:
    engine, url = speaker
    payload = orjson.dumps({**FIRST, "stream_format": "audio"}) + b"\n" + b"{oops\n" + \
        orjson.dumps({"input": "never spoken"}) + b"\n"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", data=payload,
                             headers={"Content-Type": "application/x-ndjson"}) as r:
            assert r.status == 400  # the line arrived before any audio (test_http_speech_input_limits: after)
            assert (await r.json())["error"]["param"] == "body"
    assert await wait_until(lambda: engine.num_running() == 0)


async def test_a_bad_first_line_is_a_400(speaker) -> None:
    _, url = speaker
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", data=b'{"input": ""}\n',
                             headers={"Content-Type": "application/x-ndjson"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"
