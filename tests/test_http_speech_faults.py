"""How `/v1/audio/speech` ends a request that fails, over a fake speaking
model whose counter raises at a chosen value: before any audio (a JSON 500),
after some audio went out (an audio body cut short, so the client sees an
incomplete read; an SSE stream gets an `error` event). Also: a model without
a tokenizer still speaks, and its default sampling applies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
import torch
from fake_model import Counter, Tone
from http_support import serving, wait_until
from torch import nn

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.errors import RequestError
from mstar.graph import Component, Emit, FixedChunks, Loop, MaxTokens, Step, Stream, Walk
from mstar.models.base import Model
from mstar.models.prepared import PreparedPiece
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

FAIL_AT = 100


class FakeSpeaker(Model):
    """Speaks `int(text)` + 1, + 2, ... as 4 samples each, 2 items a chunk;
    the step whose input is FAIL_AT raises. No tokenizer."""

    components = {"counter": Component(modes=("tick",)), "tone": Component(modes=("synth",))}
    walks = {"speak": Walk(
        Loop(Step("counter", "tick", "x", "x"), until=MaxTokens()),
        Stream("x", Step("tone", "synth", "x", "pcm"), FixedChunks(2)),
        Emit("pcm", modality="audio", sample_rate=24_000),
        inputs=("x",))}
    default_walk = "speak"
    tts_walk = "speak"
    voices = ("robot",)

    def default_sampling(self, key: str | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=6)

    def __init__(self) -> None:
        super().__init__("fake-speaker")
        self.counter = Counter(None)
        self.counter.fail_on = FAIL_AT

    @property
    def max_model_len(self) -> int:
        return 4096

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return {"counter": self.counter, "tone": Tone()}[component]

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        if request.inputs.get("voice") not in (None, "robot"):
            raise RequestError("unknown voice", field="voice")
        return PreparedPiece({"x": torch.tensor(int(request.inputs["text"]))}, 1)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fake_engine() -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(model="fake-speaker"), model=FakeSpeaker())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def api(fake_engine: Engine) -> AsyncIterator[aiohttp.ClientSession]:
    async with serving(fake_engine) as base, aiohttp.ClientSession(base_url=base) as session:
        yield session


def body(text: str, **fields: Any) -> dict[str, Any]:
    return {"input": text, "response_format": "pcm", **fields}


async def test_model_defaults_and_no_tokenizer(api: aiohttp.ClientSession) -> None:
    async with api.post("/v1/audio/speech", json=body("0")) as r:
        assert r.status == 200
        pcm = await r.read()
    assert len(pcm) == 6 * 4 * 2  # the model's default max_tokens: 6 items of 4 samples
    async with api.post("/v1/audio/speech", json=body("0", max_tokens=2, voice="robot")) as r:
        assert len(await r.read()) == 2 * 4 * 2


async def test_failure_before_audio_is_a_json_error(api: aiohttp.ClientSession, fake_engine: Engine) -> None:
    async with api.post("/v1/audio/speech", json=body(str(FAIL_AT))) as r:
        assert r.status == 500 and r.content_type == "application/json"
        error = (await r.json())["error"]
    assert "injected fault" in error["message"]
    assert await wait_until(lambda: fake_engine.num_running() == 0)


async def test_failure_mid_audio_cuts_the_body(api: aiohttp.ClientSession, fake_engine: Engine) -> None:
    got = b""
    async with api.post("/v1/audio/speech", json=body(str(FAIL_AT - 4), response_format="wav")) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for piece in r.content.iter_any():
                got += piece
    assert got.startswith(b"RIFF") and len(got) > 44  # the audio before the fault did go out
    assert await wait_until(lambda: fake_engine.num_running() == 0)


async def test_failure_mid_sse_is_an_error_event(api: aiohttp.ClientSession) -> None:
    async with api.post("/v1/audio/speech", json=body(str(FAIL_AT - 4), stream_format="sse")) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [orjson.loads(b[len("data: "):]) for b in raw.split("\n\n") if b.strip()]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "injected fault" in events[-1]["error"]["message"]
    assert not any(e["type"] == "speech.audio.done" for e in events)


async def test_native_route_with_a_voice(api: aiohttp.ClientSession) -> None:
    async with api.post("/generate", json={"text": "0", "voice": "robot"}) as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["sample_rate"] == 24_000 and answer["finish_reason"] == "length"
    async with api.post("/generate", json={"text": "0", "voice": "nobody"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "voice"
