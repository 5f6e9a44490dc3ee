"""Chat requests with audio and images in, text out: the official `openai`
client against qwen3-omni-tiny. An `input_audio` part is decoded off the
event loop and the model answers what it answers for the decoded samples
in-process (streamed or not, n samples from one decode); FLAC and WAV of the
same samples give the same tokens, MP3 is served; a PNG `image_url` data URL
is served (an answer of the asked length); each bad part is a 400
naming its field, a text-only model refuses media by the part's `type`, a
clip the context cannot hold is refused naming `messages`; the server's
limits are its flags'. Two requests' audio decodes are under way at once,
in two pool processes, while a third request streams."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
import pytest_asyncio
import soundfile as sf
from aiohttp import web
from http_support import MODEL as TEXT_MODEL
from http_support import running_engine, serving, serving_app, wait_until
from media_fns import Hold
from PIL import Image

from mstar.client import AsyncClient
from mstar.config import MediaLimits, ServerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.errors import ConfigError, RequestError
from mstar.http.fields import Fields
from mstar.http.keys import MEDIA
from mstar.http.media import Decoders, MediaDecoder
from mstar.http.server import build_app
from mstar.http.text.chat_messages import MediaPart, media_parts, read_messages
from mstar.http.text.logprobs import LogprobShapes
from mstar.models import media
from mstar.types import GenerateRequest, SamplingParams

on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop the module's engine and servers run on

OMNI = "qwen3-omni-tiny"
CONTEXT = 512          # ~13 audio tokens a second: a clip of 40 s or more cannot fit
TOKENS = 4
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": TOKENS, "logprobs": True,
                          "extra_body": {"ignore_eos": True}}
AUDIO_FIELD = "messages[0].content[1].input_audio"
# today a 400 naming `walk`: the model picks a 'chat+image' walk it does not have yet


# ------------------------------------------------------------------ inputs

def clip(seconds: float, rate: int = 16000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A tone with noise, [frames, channels] float32, on the 16-bit grid (so
    PCM_16 WAV and FLAC hold exactly these samples)."""
    t = np.arange(round(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal((t.size, channels))
    x = 0.3 * np.sin(2 * np.pi * (220 + 60 * seed) * t)[:, None] + 0.05 * noise
    return (np.round(x * 32767) / 32767).astype(np.float32)


def encoded(samples: np.ndarray, fmt: str, rate: int = 16000) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt.upper(), **({} if fmt == "mp3" else {"subtype": "PCM_16"}))
    return base64.b64encode(buf.getvalue()).decode()


def png_url(height: int = 32, width: int = 48) -> str:
    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def audio_part(data: str, fmt: str | None = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, **({"format": fmt} if fmt else {})}}


def asking(*parts: dict[str, Any], text: str = "what is this?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


# ------------------------------------------------------------------ servers

class Spy:
    """Wraps an app's media decoder, keeping each audio decode's (start, end)."""

    def __init__(self, app: web.Application) -> None:
        self.calls: list[tuple[float, float]] = []
        decoder = app[MEDIA]
        real = decoder.audio

        async def audio(*args: Any, **kwargs: Any) -> np.ndarray:
            start = time.perf_counter()
            try:
                return await real(*args, **kwargs)
            finally:
                self.calls.append((start, time.perf_counter()))

        decoder.audio = audio  # type: ignore[method-assign]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni() -> AsyncIterator[Engine]:
    async with running_engine(OMNI, CONTEXT) as engine:
        yield engine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def omni_app(omni: Engine) -> AsyncIterator[tuple[str, Spy]]:
    app = build_app(omni, manage_engine=False, config=ServerConfig(media_workers=2))
    spy = Spy(app)
    async with serving_app(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0) as url:
        yield url, spy


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(omni_app: tuple[str, Spy]) -> AsyncIterator[openai.AsyncOpenAI]:
    api = openai.AsyncOpenAI(base_url=f"{omni_app[0]}/v1", api_key="x", max_retries=0, timeout=120)
    yield api
    await api.close()


@pytest.fixture
def spy(omni_app: tuple[str, Spy]) -> Spy:
    omni_app[1].calls.clear()
    return omni_app[1]


async def refused(call: Awaitable[Any]) -> dict[str, Any]:
    """The 400 error body `call` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        await call
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    return body


def tokens(answer: Any) -> list[tuple[str, float]]:
    """Each choice's tokens and logprobs, from `logprobs: true`."""
    return [(t.token, t.logprob) for choice in answer.choices for t in choice.logprobs.content]


def same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> bool:
    """The same tokens, with the same logprobs but for float noise."""
    return [t for t, _ in got] == [t for t, _ in want] and \
        [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


async def in_process(engine: Engine, messages: list[dict[str, Any]]) -> tuple[list[tuple[str, float]], int]:
    """What the engine answers for `messages` (media already decoded), as the
    chat route shows its tokens, and the prompt's length."""
    request = GenerateRequest("in-process", OMNI, {"messages": messages},
                              SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0))
    stream = engine.submit(request, await engine.prepare(request))
    entries = [e async for chunk in stream for e in chunk.logprobs or ()]
    content = LogprobShapes(engine.tokenizer(OMNI)).chat(entries)["content"]
    return [(e["token"], e["logprob"]) for e in content], stream.num_prompt_tokens


# ------------------------------------------------------------------ reading parts

def test_parts_are_read_in_place_without_decoding() -> None:
    body = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hear"}, audio_part("UklGRg==", "MP3"),
                                     {"type": "image_url", "image_url": {"url": "data:,x", "detail": "low"}},
                                     {"type": "image_url", "image_url": "data:image/png;base64,AA"}]}]}
    messages = read_messages(Fields(body))
    assert messages[0] == {"role": "system", "content": "be\nbrief"}  # text alone stays one string
    text, audio, image, bare = messages[1]["content"]
    assert text == {"type": "text", "text": "hear"}
    assert audio == MediaPart("audio", "UklGRg==", "mp3", "messages[1].content[1].input_audio.data",
                              "messages[1].content[1]")
    assert image == MediaPart("image", "data:,x", None, "messages[1].content[2].image_url.url",
                              "messages[1].content[2]")
    assert bare.field == "messages[1].content[3].image_url" and bare.payload == "data:image/png;base64,AA"
    assert media_parts(messages) == [audio, image, bare]


@pytest.mark.parametrize(("part", "field", "says"), [
    ({"type": "input_video", "input_video": {}}, "type", "not supported"),
    ({"type": "input_audio"}, "input_audio", "required"),
    ({"type": "input_audio", "input_audio": "UklGRg=="}, "input_audio", "JSON object"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data", "required"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio.data", "empty"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}, "input_audio.format", "aac"),
    ({"type": "input_audio", "input_audio": {"data": "data:audio/wav;base64,UklGRg==", "format": "wav"}},
     "input_audio.data", "is a data URL"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "image_url.url", "required"),
    ({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}, "image_url.detail", "ultra"),
    ({"type": "image_url", "image_url": 7}, "image_url", "JSON object"),
    ({"type": "image_url", "image_url": {"url": "data:,", "detial": "low"}}, "image_url.detial", "unknown field"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "fromat": "wav"}}, "input_audio.fromat", "unknown field"),
    ({"type": "refusal", "refusal": "no"}, "type", "assistant message"),
    ({"type": "input_text"}, "text", "required"),
])
def test_malformed_parts_are_refused_naming_their_field(part: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(RequestError) as caught:
        read_messages(Fields({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}))
    assert caught.value.field == f"messages[0].content[1].{field}" and says in caught.value.message


def test_an_empty_array_of_parts_is_refused_but_from_the_assistant() -> None:
    with pytest.raises(RequestError) as caught:
        read_messages(Fields({"messages": [{"role": "user", "content": []}]}))
    assert caught.value.field == "messages[0].content" and "empty array" in caught.value.message
    messages = read_messages(Fields({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": []}]}))
    assert messages[1] == {"role": "assistant", "content": ""}


def test_input_text_parts_and_an_answers_refusal_parts_are_text() -> None:
    """As vLLM reads them: the Responses API's `input_text`, and an earlier
    answer's `refusal` replayed in the history (OpenAI's schema allows it in
    assistant messages only)."""
    messages = read_messages(Fields({"messages": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}]}))
    assert messages == ({"role": "user", "content": "hi\nthere"},
                        {"role": "assistant", "content": "I can't help with that."})
    with pytest.raises(RequestError) as caught:
        read_messages(Fields({"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}))
    assert caught.value.field == "messages[0].content[0].refusal"


def test_the_limits_are_flags() -> None:
    assert parse_args([]).media_limits == MediaLimits(600.0, 4096 * 4096)
    assert parse_args(["--max-audio-seconds", "30", "--max-image-pixels", "1000"]).media_limits == \
        MediaLimits(30.0, 1000)
    for bad in (["--max-audio-seconds", "0"], ["--max-audio-seconds", "inf"], ["--max-image-pixels", "0"]):
        with pytest.raises(ConfigError, match="--max-audio-seconds and --max-image-pixels"):
            parse_args(bad)


# ------------------------------------------------------------------ served

@on_module_loop
async def test_models_list_what_they_take(client: openai.AsyncOpenAI, omni_app: tuple[str, Spy],
                                          engine: Engine) -> None:
    [model] = (await client.models.list()).data
    assert model.id == OMNI and model.model_extra is not None
    assert model.model_extra["input_modalities"] == ["text", "audio", "image"]
    async with AsyncClient(omni_app[0]) as sdk:
        assert (await sdk.model(OMNI)).input_modalities == ("text", "audio", "image")
    async with serving(engine) as url, AsyncClient(url) as sdk:
        assert (await sdk.model(TEXT_MODEL)).input_modalities == ("text",)
        assert (await sdk.model(TEXT_MODEL)).raw["input_modalities"] == ["text"]


@on_module_loop
async def test_audio_is_heard_as_the_decoded_samples(client: openai.AsyncOpenAI, omni: Engine, spy: Spy) -> None:
    data = encoded(clip(1.5), "wav")
    answer = await client.chat.completions.create(model=OMNI, messages=asking(audio_part(data)), **GREEDY)
    decoded = media.audio_from_base64(data, "x", max_seconds=10)
    want, prompt = await in_process(omni, asking({"type": "audio", "audio": decoded}))
    assert same(tokens(answer), want) and len(want) == TOKENS
    assert answer.usage is not None and answer.usage.prompt_tokens == prompt
    silent = await client.chat.completions.create(model=OMNI, messages=asking(), **GREEDY)
    assert silent.usage is not None and prompt > silent.usage.prompt_tokens + 15  # 1.5 s: ~20 audio tokens
    other = await client.chat.completions.create(
        model=OMNI, messages=asking(audio_part(encoded(clip(1.5, seed=3), "wav"))), **GREEDY)
    assert [lp for _, lp in tokens(other)] != [lp for _, lp in tokens(answer)]  # what it hears moves the answer
    assert len(spy.calls) == 2


@on_module_loop
async def test_streamed_and_n_samples_decode_once(client: openai.AsyncOpenAI, spy: Spy) -> None:
    messages = asking(audio_part(encoded(clip(1.0, seed=1), "wav")), text="and this?")
    whole = await client.chat.completions.create(model=OMNI, messages=messages, **GREEDY)
    assert len(spy.calls) == 1
    stream = await client.chat.completions.create(model=OMNI, messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [(t.token, t.logprob) for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert same(streamed, tokens(whole))
    assert chunks[-1].usage == whole.usage
    several = await client.chat.completions.create(model=OMNI, messages=messages, n=3, **GREEDY)
    assert len(several.choices) == 3 and all(c.finish_reason == "length" for c in several.choices)
    assert several.usage is not None and several.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len(spy.calls) == 3  # one per request, however many samples it asks


@on_module_loop
async def test_two_parts_decode_at_once(client: openai.AsyncOpenAI, spy: Spy) -> None:
    messages = asking(audio_part(encoded(clip(2.0, seed=1), "wav")), audio_part(encoded(clip(1.0, seed=2), "flac"),
                                                                               "flac"))
    answer = await client.chat.completions.create(model=OMNI, messages=messages, **GREEDY)
    assert len(tokens(answer)) == TOKENS
    (start_a, end_a), (start_b, end_b) = spy.calls
    assert max(start_a, start_b) < min(end_a, end_b)  # the second began before the first ended


@on_module_loop
async def test_formats_of_the_same_samples_give_the_same_tokens(client: openai.AsyncOpenAI) -> None:
    samples = clip(1.2, rate=16000, seed=4)

    async def answer(fmt: str, declared: str | None) -> Any:
        return await client.chat.completions.create(
            model=OMNI, messages=asking(audio_part(encoded(samples, fmt), declared)), **GREEDY)

    wav = await answer("wav", "wav")
    assert same(tokens(await answer("flac", "flac")), tokens(wav))  # lossless: the same samples
    assert same(tokens(await answer("flac", None)), tokens(wav))    # the bytes say what they are
    mp3 = await answer("mp3", "mp3")  # lossy: other samples, so other numbers, but heard
    assert len(tokens(mp3)) == TOKENS and mp3.usage is not None and mp3.usage.prompt_tokens >= wav.usage.prompt_tokens


@on_module_loop
async def test_an_image_is_seen(client: openai.AsyncOpenAI) -> None:
    for image_url in ({"url": png_url(), "detail": "auto"}, png_url(40, 40)):
        answer = await client.chat.completions.create(
            model=OMNI, messages=asking({"type": "image_url", "image_url": image_url}, text="what is in it?"),
            **GREEDY)
        assert len(tokens(answer)) == TOKENS


@pytest.mark.parametrize(("part", "field", "says"), [
    (audio_part(base64.b64encode(b"RIFF but not really audio at all").decode()), f"{AUDIO_FIELD}.data",
     "is not audio"),
    (audio_part("not base64!"), f"{AUDIO_FIELD}.data", "base64"),
    (audio_part("AAAA", "aac"), f"{AUDIO_FIELD}.format", "aac"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages[0].content[1].image_url.url", "does not fetch"),
    ({"type": "image_url", "image_url": "http://example.com/cat.png"}, "messages[0].content[1].image_url",
     "does not fetch"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}},
     "messages[0].content[1].image_url.url", "not of an image"),
])
@on_module_loop
async def test_bad_parts_are_400s_naming_their_field(client: openai.AsyncOpenAI, part: dict[str, Any], field: str,
                                                     says: str) -> None:
    error = await refused(client.chat.completions.create(model=OMNI, messages=asking(part), max_tokens=2))
    assert error["param"] == field and says in error["message"], error


@on_module_loop
async def test_placeholder_ids_without_their_media_name_the_prompts_field(client: openai.AsyncOpenAI,
                                                                         omni_app: tuple[str, Spy]) -> None:
    """An image's placeholder ids sent as a prompt, without the image: a 400
    naming the field the ids came in (`prompt`, `input_ids`), one the client has."""
    async with aiohttp.ClientSession(base_url=omni_app[0]) as http:
        async with http.post("/tokenize", json={"model": OMNI, "messages": asking(
                {"type": "image_url", "image_url": {"url": png_url()}})}) as r:
            ids = (await r.json())["tokens"]
        error = await refused(client.completions.create(model=OMNI, prompt=ids, max_tokens=2))
        assert error["param"] == "prompt" and "image placeholders" in error["message"], error
        async with http.post("/generate", json={"model": OMNI, "input_ids": ids,
                                                "sampling_params": {"max_tokens": 2}}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == "input_ids" and "image placeholders" in error["message"], error


@on_module_loop
async def test_a_text_model_refuses_media_by_the_parts_type(engine: Engine) -> None:
    async with serving(engine) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        # undecodable payloads: the type is refused before anything is decoded
        for part, kind in ((audio_part("AAAA"), "input_audio"),
                           ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url")):
            error = await refused(api.chat.completions.create(model=TEXT_MODEL, messages=asking(part), max_tokens=2))
            assert error["param"] == "messages[0].content[1].type", error
            assert "takes only text" in error["message"] and kind in error["message"], error
        # text parts alone are still read by a text model
        answer = await api.chat.completions.create(
            model=TEXT_MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=2,
            extra_body={"ignore_eos": True})  # random weights may draw EOS at once
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2
        await api.close()


@on_module_loop
async def test_a_clip_past_the_context_is_refused_naming_messages(client: openai.AsyncOpenAI) -> None:
    error = await refused(client.chat.completions.create(
        model=OMNI, messages=asking(audio_part(encoded(clip(45.0), "wav"))), max_tokens=2))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error


@on_module_loop
async def test_the_servers_limits_apply(omni: Engine) -> None:
    limits = MediaLimits(max_audio_seconds=1.0, max_image_pixels=100)
    app = build_app(omni, manage_engine=False, config=ServerConfig(media_workers=1, media_limits=limits))
    async with serving_app(app, access_log=None, shutdown_timeout=1.0) as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        error = await refused(api.chat.completions.create(
            model=OMNI, messages=asking(audio_part(encoded(clip(1.5), "wav"))), max_tokens=2))
        assert error["param"] == f"{AUDIO_FIELD}.data" and "longer than the 1 s" in error["message"], error
        error = await refused(api.chat.completions.create(
            model=OMNI, messages=asking({"type": "image_url", "image_url": {"url": png_url(20, 20)}}), max_tokens=2))
        assert error["param"] == "messages[0].content[1].image_url.url" and "more than the 100" in error["message"]
        await api.close()


# ------------------------------------------------------- decodes in the pool, beside the loop

@on_module_loop
async def test_audio_decodes_at_once_while_another_request_streams(omni: Engine, tmp_path: Path) -> None:
    """Two requests, each with 45 s of MP3 (too long for the context, so the
    model refuses it once decoded: no step runs for it), through an app whose
    decodes wait at their start, in their pool process, until released: both
    are held at once, in two processes, and a third request's stream, begun
    then, keeps coming meanwhile; released, both decode and are refused."""
    hold = Hold(tmp_path)
    app = build_app(omni, manage_engine=False, config=ServerConfig(media_workers=2))
    decoder = app[MEDIA] = MediaDecoder(app[MEDIA].workers, Decoders(audio=hold(media.audio_from_base64),
                                                                     image=media.image_from_data_url))

    async def stop_decoder(_: web.Application) -> None:
        await decoder.close()

    app.on_cleanup.append(stop_decoder)
    body = orjson.dumps({"model": OMNI, "messages": asking(audio_part(encoded(clip(45.0), "mp3"), "mp3")),
                         "max_tokens": 2})
    events: list[bytes] = []
    async with serving_app(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0) as url, \
            aiohttp.ClientSession(base_url=url) as http:
        async def post() -> tuple[int, dict[str, Any]]:
            async with http.post("/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

        async def stream() -> None:
            async with http.post("/v1/chat/completions", json={
                    "model": OMNI, "messages": asking(), "max_tokens": CONTEXT // 2, "stream": True,
                    "temperature": 0, "ignore_eos": True, "logprobs": True}) as r:  # an event per token
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data:"):
                        events.append(line)

        posts = [asyncio.ensure_future(post()) for _ in range(2)]
        tasks = list(posts)
        try:
            pids = await hold.started(2, posts)
            # at once, each in a pool process of its own: not on the loop, not one after the other
            assert len(set(pids)) == 2 and os.getpid() not in pids, pids
            streaming = asyncio.ensure_future(stream())  # begun while both decodes are held
            tasks.append(streaming)
            assert await wait_until(lambda: len(events) >= 5 or streaming.done(), timeout=30), events
            assert len(events) >= 5, (events, streaming.done() and streaming.exception())
            assert not any(p.done() for p in posts) and hold.pids() == pids  # still held, the two of them
        finally:
            hold.release()
            for task in tasks[len(posts):]:  # the stream, once begun
                task.cancel()
            _, late = await asyncio.wait(tasks, timeout=60)
            assert not late, late
        answers = [p.result() for p in posts]
    for status, answer in answers:
        assert status == 400 and answer["error"]["param"] == "messages", answer


def test_spoken_answers_are_kept_for_their_hour_and_the_newest_only() -> None:
    from mstar.http.text.transcripts import Transcripts

    kept = Transcripts(keep_s=3600, max_kept=2)
    now = int(time.time())
    kept.keep("a", "first", now)
    kept.keep("b", "second", now - 3601)   # made over an hour ago: expired
    messages = read_messages(Fields({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "audio": {"id": "a"}},
                                                  {"role": "user", "content": "more"}]}))
    assert kept.resolve(messages)[1] == {"role": "assistant", "content": "first"}
    for gone in ("b", "nobody"):
        with pytest.raises(RequestError) as caught:
            kept.resolve(read_messages(Fields({"messages": [{"role": "assistant", "audio": {"id": gone}}]})))
        assert caught.value.field == "messages[0].audio.id" and "transcript" in caught.value.message
    kept.keep("c", "third", now)
    kept.keep("d", "fourth", now)   # past max_kept: the oldest, "a", is dropped
    with pytest.raises(RequestError):
        kept.resolve(read_messages(Fields({"messages": [{"role": "assistant", "audio": {"id": "a"}}]})))
    assert kept.expires_at(now) == now + 3600
