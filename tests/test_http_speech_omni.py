"""`/v1/audio/speech` (and `/generate`'s speech) over qwen3-omni-tiny, whose
text-to-speech walk is `tts` (its code2wav made loud enough for PCM16): the
official `openai` client gets, in each voice and each format, the samples
the engine speaks for the same request, as many as the talker's frames make;
voices differ; no voice is Ethan; SSE pieces join to the same audio; the
walk's own defaults (the talker's) apply, within the context; an unknown
voice is a 400 listing the voices, and so is text streamed into a walk that
takes none."""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import pytest_asyncio
import soundfile as sf
from http_support import running_engine, serving
from test_http_chat_audio import OMNI, RATE

from mstar.engine.engine import Engine
from mstar.http.speech.audio import wav_header
from mstar.http.submission import Targets
from mstar.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONTEXT = 512
VOICES = ("ethan", "chelsie", "aiden")  # the default first
TEXT = "Hello there."
FRAMES = 6          # the tts walk's root is the talker: max_tokens is its draws, a frame each but the last
SAMPLES = 1920 * (FRAMES - 1) - 555
# greedy, and no codec EOS: the same codes every time, as many as asked
TALK: dict[str, Any] = {"max_tokens": FRAMES, "temperature": 0,
                        "sampling_by": {"talker": {"ignore_eos": True}, "cp": {"temperature": 0}}}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni() -> AsyncIterator[Engine]:
    async with running_engine(OMNI, CONTEXT) as engine:
        yield engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def url(omni: Engine) -> AsyncIterator[str]:
    async with serving(omni) as base:
        yield base


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    yield api
    await api.close()


async def spoken(engine: Engine, voice: str) -> bytes:
    """The PCM16 the engine speaks for TEXT in `voice` under TALK, over the talker's defaults as the route's."""
    talker = omni_defaults(engine)
    request = GenerateRequest(f"in-process-{voice}", OMNI, {"text": TEXT, "voice": voice},
                              dataclasses.replace(talker, max_tokens=FRAMES, temperature=0), walk="tts",
                              sampling_by=TALK["sampling_by"])
    return b"".join([c.audio async for c in engine.submit(request, await engine.prepare(request)) if c.audio])


def omni_defaults(engine: Engine) -> SamplingParams:
    return engine.model.default_sampling("talker")  # type: ignore[union-attr]


async def speak(client: openai.AsyncOpenAI, voice: str | None, fmt: str, **fields: Any) -> bytes:
    extra = {**TALK, **fields}
    if voice is None:
        extra["voice"] = None  # left out: the client's `voice` is a required argument
    answer = await client.audio.speech.create(model=OMNI, voice=voice or "ethan", input=TEXT,
                                              response_format=fmt, extra_body=extra)  # type: ignore[arg-type]
    return answer.content


@pytest.mark.parametrize("voice", VOICES)
@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3", "opus"])
async def test_each_voice_in_each_format(client: openai.AsyncOpenAI, omni: Engine, voice: str, fmt: str) -> None:
    want = await spoken(omni, voice)
    assert len(want) == 2 * SAMPLES and np.abs(np.frombuffer(want, dtype="<i2")).max() > 0
    if fmt in ("pcm", "wav"):  # streamed: a WAV's header says "until the end"
        body = await speak(client, voice, fmt)
        assert body == (wav_header(RATE) if fmt == "wav" else b"") + want
        return
    body = await speak(client, voice, fmt, stream=False)  # one file: its header has the true sizes
    samples, rate = sf.read(io.BytesIO(body), dtype="int16")
    assert rate == RATE
    if fmt == "flac":  # lossless
        assert samples.tobytes() == want
    else:  # lossy: as long, but for the codec's delay and padding
        assert SAMPLES <= len(samples) <= SAMPLES + 3000


async def test_voices_differ_and_ethan_is_the_default(client: openai.AsyncOpenAI) -> None:
    ethan, chelsie, aiden = [await speak(client, voice, "pcm") for voice in VOICES]
    assert len({chelsie, ethan, aiden}) == 3
    assert await speak(client, None, "pcm") == ethan
    assert await speak(client, "Aiden", "pcm") == aiden  # names in any case, as the model reads them


async def test_greedy_speech_without_a_seed_repeats(client: openai.AsyncOpenAI) -> None:
    """`temperature` 0 reaches the talker only; its code predictor keeps sampling under its own key, from the
    greedy request's fixed seed: the same audio on every run. Sampled, without a seed, it differs."""
    greedy = {"max_tokens": FRAMES, "temperature": 0, "sampling_by": {"talker": {"ignore_eos": True}}}
    first, second = [await speak(client, "ethan", "pcm", **greedy) for _ in range(2)]
    assert len(first) == 2 * SAMPLES and first == second
    sampled = {**greedy, "temperature": 0.9}
    assert await speak(client, "ethan", "pcm", **sampled) != await speak(client, "ethan", "pcm", **sampled)


async def test_sse_pieces_join_to_the_audio(url: str, omni: Engine) -> None:
    body = {"model": OMNI, "input": TEXT, "voice": "chelsie", "response_format": "pcm", "stream_format": "sse",
            **TALK}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200 and r.headers["X-Sample-Rate"] == str(RATE)
        events = [orjson.loads(b[len("data: "):]) for b in (await r.read()).decode().split("\n\n") if b.strip()]
    *deltas, done = events
    assert len(deltas) >= FRAMES - 1 and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == await spoken(omni, "chelsie")
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == FRAMES


async def test_generate_with_a_voice_speaks_on_the_tts_walk(url: str, omni: Engine) -> None:
    body = {"model": OMNI, "text": TEXT, "voice": "aiden", "sampling_by": TALK["sampling_by"],
            "sampling_params": {"max_tokens": FRAMES, "temperature": 0}}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert base64.b64decode(answer["audio"]) == await spoken(omni, "aiden") and answer["sample_rate"] == RATE


async def test_the_walks_own_defaults_apply_within_the_context(omni: Engine) -> None:
    [card] = omni.model_cards()
    assert (card.tts_walk, card.spoken_chat_walk, card.voices) == ("tts", "speak", VOICES)
    talker = omni_defaults(omni)
    # the codec's EOS ends the talker as its key's EOS (`eos_ids`), not as a stop id a request's own would replace
    assert card.tts_sampling == talker and talker.temperature == 0.9 and talker.stop_token_ids == ()
    assert talker.max_tokens == CONTEXT  # the released 4096 frames, within this server's context
    # a default no prompt leaves room for: whatever room the prompt leaves
    assert Targets(omni).resolve(OMNI).tts_sampling.max_tokens is None


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"voice": "nobody"}, "voice", "aiden, chelsie, ethan"),
    ({"voice": {"id": "nobody"}}, "voice", "aiden, chelsie, ethan"),
    ({"max_tokens": CONTEXT}, "max_tokens", "context"),
    ({"input": " "}, "input", "empty"),
    ({"speed": 1.5}, "speed", "1.0"),
])
async def test_refusals_name_the_field(client: openai.AsyncOpenAI, omni: Engine, body: dict[str, Any], param: str,
                                       says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        fields = {"model": OMNI, "voice": "ethan", "input": TEXT, **body}
        extra = {key: fields.pop(key) for key in ("max_tokens",) if key in fields}  # mstar's, not the client's
        await client.audio.speech.create(**fields, extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"], error
    assert omni.num_running() == 0


async def test_text_streamed_in_is_refused_naming_input(url: str, omni: Engine) -> None:
    lines = orjson.dumps({"model": OMNI, "input": TEXT, "voice": "ethan", **TALK}) + b"\n" + \
        orjson.dumps({"input": "and more"}) + b"\n"
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/audio/speech", data=lines, headers={"Content-Type": "application/x-ndjson"}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "input" and "takes no input while it runs" in error["message"], error
    assert omni.num_running() == 0
