"""`POST /v1/audio/speech` and speech on `/generate` against the real
`orpheus-tiny` engine (random weights that speak noise) on a loopback port:
every response format streamed and decoded, SSE events, the 4xx answers, the
official `openai` client, and a client that hangs up."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import pytest_asyncio
import yarl
from http_support import read_ndjson, running_engine, serving, wait_until

from mstar.engine.engine import Engine
from mstar.http.speech.audio import wav_header
from mstar.http.submission import model_defaults
from mstar.models.registry import BUILTINS

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEAKER = "orpheus-tiny"
RATE = 24_000
FRAME_BYTES = 2048 * 2  # one SNAC frame of PCM16: every window plays whole frames
# ~10 frames of audio: short enough for a CPU, long enough for several chunks
SHORT = {"max_tokens": 77, "seed": 11}

if SPEAKER not in BUILTINS:
    pytest.skip(f"{SPEAKER} is not a builtin model here", allow_module_level=True)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speaker() -> AsyncIterator[Engine]:
    async with running_engine(SPEAKER) as e:
        yield e


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speech_server(speaker: Engine) -> AsyncIterator[str]:
    async with serving(speaker) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def api(speech_server: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=speech_server) as session:
        yield session


def speech(**fields: Any) -> dict[str, Any]:
    return {"model": SPEAKER, "input": "Hello from mstar.", "voice": "tara", **SHORT, **fields}


async def http_chunks(r: aiohttp.ClientResponse) -> list[bytes]:
    """The body as the server's HTTP chunks (one per write)."""
    out, part = [], b""
    async for data, end_of_chunk in r.content.iter_chunks():
        part += data
        if end_of_chunk:
            out.append(part)
            part = b""
    if part:
        out.append(part)
    return out


async def fetch(api: aiohttp.ClientSession, **fields: Any) -> tuple[aiohttp.ClientResponse, list[bytes]]:
    async with api.post("/v1/audio/speech", json=speech(**fields)) as r:
        assert r.status == 200, await r.text()
        return r, await http_chunks(r)


async def reference_pcm(api: aiohttp.ClientSession, **fields: Any) -> bytes:
    _, chunks = await fetch(api, response_format="pcm", **fields)
    return b"".join(chunks)


async def reference_length(api: aiohttp.ClientSession, **fields: Any) -> int:
    """PCM bytes of `speech(**fields)`. A seed fixes the tokens, hence the
    length; the samples themselves carry SNAC's decoder noise, so only the
    length is compared across requests."""
    return len(await reference_pcm(api, **fields))


async def usage_of(api: aiohttp.ClientSession, **fields: Any) -> dict[str, int]:
    async with api.post("/v1/audio/speech", json=speech(stream_format="sse", **fields)) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    done = orjson.loads(raw.strip().split("\n\n")[-1][len("data: "):])
    assert done["type"] == "speech.audio.done"
    return done["usage"]


async def test_the_model_list_names_the_voices(api: aiohttp.ClientSession) -> None:
    async with api.get("/v1/models") as r:
        [card] = (await r.json())["data"]
    assert card["voices"] == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]


async def test_wav_streams_the_header_first_then_the_audio(api: aiohttp.ClientSession) -> None:
    r, chunks = await fetch(api, response_format="wav")
    assert r.content_type == "audio/wav" and r.headers["Transfer-Encoding"] == "chunked"
    assert r.headers["X-Sample-Rate"] == str(RATE)
    assert chunks[0] == wav_header(RATE)  # written alone, before any audio existed
    assert len(chunks) > 3                # audio went out in pieces as it came
    pcm = b"".join(chunks[1:])
    assert pcm and len(pcm) % FRAME_BYTES == 0
    assert len(pcm) == await reference_length(api)  # the same seed, the same tokens, as long


async def test_pcm_is_raw_samples(api: aiohttp.ClientSession) -> None:
    r, chunks = await fetch(api, response_format="pcm")
    assert r.content_type == "audio/pcm" and r.headers["X-Sample-Rate"] == str(RATE)
    pcm = np.frombuffer(b"".join(chunks), dtype="<i2")
    assert len(pcm) % 2048 == 0 and np.abs(pcm).max() > 0


async def test_flac_decodes_to_the_same_samples(api: aiohttp.ClientSession) -> None:
    soundfile = pytest.importorskip("soundfile")
    r, chunks = await fetch(api, response_format="flac")
    assert r.content_type == "audio/flac"
    flac = bytearray(b"".join(chunks))
    assert flac[:4] == b"fLaC"
    samples = await reference_length(api) // 2
    # streamed FLAC leaves the total sample count at 0 (unknown); soundfile's reader needs it
    field = int.from_bytes(flac[18:26], "big")
    assert field >> 44 == RATE and field & (2**36 - 1) == 0
    flac[18:26] = (field | samples).to_bytes(8, "big")
    data, rate = soundfile.read(io.BytesIO(bytes(flac)), dtype="int16")
    assert rate == RATE and len(data) == samples and np.abs(data).max() > 0
    # (sample-exact FLAC round trips are in test_http_audio.py)


@pytest.mark.parametrize("fmt, content_type", [("mp3", "audio/mpeg"), ("opus", "audio/ogg")])
async def test_lossy_formats_decode(api: aiohttp.ClientSession, fmt: str, content_type: str) -> None:
    soundfile = pytest.importorskip("soundfile")
    r, chunks = await fetch(api, response_format=fmt)
    assert r.content_type == content_type
    data, rate = soundfile.read(io.BytesIO(b"".join(chunks)), dtype="int16")
    samples = await reference_length(api) // 2
    assert rate == RATE and samples <= len(data) <= samples + 3000  # codec delay and padding only


async def test_default_format_is_mp3_as_openai(api: aiohttp.ClientSession) -> None:
    body = speech()
    async with api.post("/v1/audio/speech", json=body) as r:
        assert r.status == 200 and r.content_type == "audio/mpeg"


async def test_sse_events(api: aiohttp.ClientSession, speaker: Engine) -> None:
    async with api.post("/v1/audio/speech", json=speech(response_format="wav", stream_format="sse")) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks)
    events = [orjson.loads(b[len("data: "):]) for b in blocks]
    *deltas, done = events
    assert deltas and all(e["type"] == "speech.audio.delta" and set(e) == {"type", "audio"} for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio[:44] == wav_header(RATE) and len(audio) - 44 == await reference_length(api)
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_voices(api: aiohttp.ClientSession) -> None:
    # the voice's name is in the prompt ("tara: Hello ..."), one byte token per letter
    tara = (await usage_of(api))["input_tokens"]
    assert (await usage_of(api, voice="leo"))["input_tokens"] == tara - 1
    assert (await usage_of(api, voice={"id": "tara"}))["input_tokens"] == tara  # OpenAI's voice object
    body = speech(stream_format="sse")
    del body["voice"]  # no voice: the model's default, tara
    async with api.post("/v1/audio/speech", json=body) as r:
        raw = (await r.read()).decode()
    assert orjson.loads(raw.strip().split("\n\n")[-1][len("data: "):])["usage"]["input_tokens"] == tara


async def test_the_models_default_sampling_is_used(speaker: Engine) -> None:
    defaults = model_defaults(speaker)
    assert defaults == speaker.model.default_sampling()  # Orpheus's published defaults
    assert speaker.model_cards()[0].voices == speaker.model.voices
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (0.6, 0.8, 1.3)


async def test_sampling_extensions_apply(api: aiohttp.ClientSession) -> None:
    short = await reference_pcm(api)
    assert len(short) == await reference_length(api)  # a seed gives the same tokens every time
    _, chunks = await fetch(api, response_format="pcm", max_tokens=42)
    assert 0 < len(b"".join(chunks)) < len(short)
    _, greedy = await fetch(api, response_format="pcm", temperature=0, top_p=0.5, repetition_penalty=1.1,
                            ignore_eos=True)
    assert b"".join(greedy)


@pytest.mark.parametrize("fields, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"input": "x" * 5000}, 400, "input"),
    ({"voice": "nobody"}, 400, "voice"),
    ({"response_format": "aac"}, 400, "response_format"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"stream_format": "ws"}, 400, "stream_format"),
    ({"speed": 2.0}, 400, "speed"),
    ({"speed": "fast"}, 400, "speed"),
    ({"instructions": "whisper"}, 400, "instructions"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 4000}, 400, "max_tokens"),
    ({"voices": "tara"}, 400, "voices"),
    ({"model": "no-such-model"}, 404, "model"),
])
async def test_refusals_name_the_field(api: aiohttp.ClientSession, speaker: Engine, fields: dict[str, Any],
                                       status: int, param: str) -> None:
    body = {k: v for k, v in speech(**fields).items() if v is not None}
    async with api.post("/v1/audio/speech", json=body) as r:
        assert r.status == status, await r.text()
        error = (await r.json())["error"]
    assert error["param"] == param, error
    assert await wait_until(lambda: speaker.num_running() == 0)


async def test_early_audio_plays_as_many_frames(api: aiohttp.ClientSession) -> None:
    """The early walk's first frame comes from a 2-frame window; every frame is heard, once."""
    r, chunks = await fetch(api, response_format="pcm", early_audio=True)
    assert len(b"".join(chunks)) == await reference_length(api)
    async with api.post("/v1/audio/speech", json=speech(early_audio="yes")) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "early_audio"


async def test_speed_one_and_empty_instructions_are_accepted(api: aiohttp.ClientSession) -> None:
    _, chunks = await fetch(api, response_format="pcm", speed=1.0, instructions="")
    assert len(b"".join(chunks)) == await reference_length(api)


async def test_a_text_model_does_not_speak(http: aiohttp.ClientSession) -> None:
    async with http.post("/v1/audio/speech", json={"input": "hi", "response_format": "wav"}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "model" and "speak" in error["message"]


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_an_http10_client_gets_the_stream_closed_by_the_connection(speech_server: str, api: aiohttp.ClientSession,
                                                                        stream_format: str) -> None:
    """HTTP/1.0 has no chunked encoding: the streamed body ends where the
    server closes the connection, as on the text routes."""
    body = orjson.dumps(speech(response_format="pcm", stream_format=stream_format))
    url = yarl.URL(speech_server)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"POST /v1/audio/speech HTTP/1.0\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    answer = await asyncio.wait_for(reader.read(), 120)  # to the end of the connection
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower(), head
    if stream_format == "audio":
        assert len(payload) == await reference_length(api) > 0
    else:
        assert payload.rstrip().split(b"\n\n")[-1].startswith(b'data: {"type":"speech.audio.done"')


async def test_client_hanging_up_aborts_the_request(api: aiohttp.ClientSession, speaker: Engine) -> None:
    body = speech(response_format="pcm", max_tokens=1500, ignore_eos=True)
    async with api.post("/v1/audio/speech", json=body) as r:
        assert r.status == 200
        await r.content.readany()  # audio is flowing
        assert speaker.num_running() == 1
    # leaving the block closed the connection mid-body
    assert await wait_until(lambda: speaker.num_running() == 0 and speaker.pages_in_use() == 0)


async def test_native_generate_streams_audio(api: aiohttp.ClientSession) -> None:
    length = await reference_length(api)
    request = {"model": SPEAKER, "text": "Hello from mstar.", "voice": "tara", "walk": "speak",
               "sampling_params": SHORT}
    async with api.post("/generate", json={**request, "stream": True}) as r:
        assert r.status == 200
        lines = await read_ndjson(r)
    with_audio = [line for line in lines if "audio" in line]
    assert len(with_audio) > 1 and all(line["sample_rate"] == RATE for line in with_audio)
    assert len(b"".join(base64.b64decode(line["audio"]) for line in with_audio)) == length
    assert lines[-1]["finished"] and lines[-1]["finish_reason"] in ("stop", "length")
    # one answer: the whole waveform; the walk and the voice default to speak and tara
    async with api.post("/generate", json={"text": "Hello from mstar.", "sampling_params": SHORT}) as r:
        assert r.status == 200
        body = await r.json()
    assert len(base64.b64decode(body["audio"])) == length and body["sample_rate"] == RATE
    assert body["usage"]["prompt_tokens"] > 0
    # the early walk is a speech walk too: the voice defaults and the model's speech sampling apply
    async with api.post("/generate", json={"text": "Hello from mstar.", "walk": "speak_early",
                                           "sampling_params": SHORT}) as r:
        assert r.status == 200
        early = await r.json()
    assert len(base64.b64decode(early["audio"])) == length


async def test_native_generate_speech_errors(api: aiohttp.ClientSession) -> None:
    for request, param in (({"text": "hi", "voice": "nobody"}, "voice"),
                           ({"text": " ", "voice": "tara"}, "text"),
                           ({"input_ids": [1, 2], "voice": "tara"}, "voice")):
        async with api.post("/generate", json=request) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == param


# ------------------------------------------------------------ the openai client


@pytest_asyncio.fixture(loop_scope="module")
async def client(speech_server: str) -> AsyncIterator[openai.AsyncOpenAI]:
    api = openai.AsyncOpenAI(base_url=f"{speech_server}/v1", api_key="x", max_retries=0, timeout=60)
    yield api
    await api.close()


async def test_openai_client_speech(client: openai.AsyncOpenAI, api: aiohttp.ClientSession) -> None:
    answer = await client.audio.speech.create(model=SPEAKER, voice="tara", input="Hello from mstar.",
                                              response_format="wav", extra_body=SHORT)
    wav = answer.content
    assert wav[:44] == wav_header(RATE) and len(wav) - 44 == await reference_length(api)


async def test_openai_client_streaming_speech(client: openai.AsyncOpenAI, api: aiohttp.ClientSession) -> None:
    pieces = []
    async with client.audio.speech.with_streaming_response.create(
            model=SPEAKER, voice="tara", input="Hello from mstar.", response_format="pcm", extra_body=SHORT) as r:
        assert r.headers["content-type"].startswith("audio/pcm")
        async for piece in r.iter_bytes():
            pieces.append(piece)
    assert len(pieces) > 1 and len(b"".join(pieces)) == await reference_length(api)


async def test_openai_client_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.audio.speech.create(model=SPEAKER, voice="nobody", input="hi")
    assert "voice" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        await client.audio.speech.create(model="no-such-model", voice="tara", input="hi")


async def test_a_text_that_leaves_less_room_than_the_default_budget_is_spoken(speaker: Engine,
                                                                              api: aiohttp.ClientSession) -> None:
    """Orpheus's default budget (1200 tokens) is a ceiling: a text that
    leaves less room in the context (2048) is spoken within that room. A
    max_tokens the client sets is its own ask, and too large is refused."""
    body = speech(input="hello " * 300, stream_format="sse", seed=3)
    del body["max_tokens"]
    async with api.post("/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        raw = (await r.read()).decode()
    usage = orjson.loads(raw.strip().split("\n\n")[-1][len("data: "):])["usage"]
    room = speaker.model.max_model_len - usage["input_tokens"]
    assert room < model_defaults(speaker).max_tokens
    assert 0 < usage["output_tokens"] <= room
    async with api.post("/v1/audio/speech", json={**body, "max_tokens": room + 1}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "max_tokens"
