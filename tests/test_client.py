"""`mstar.client` against real servers on CPU: tiny-llama for the text routes,
orpheus-tiny for speech, each served on a loop of its own thread so that the
blocking `Client` can wait on it (and be called from inside a running loop,
as in Jupyter). A stub server covers what a real one will not do on demand:
429 with Retry-After, and an error event in the middle of a stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import io
import subprocess
import sys
import threading
import time
import wave
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web
from http_support import running_engine, serving, serving_app

from mstar.client import AsyncClient, Client, Completion, MstarError

ROOT = Path(__file__).resolve().parents[1]
RATE = 24_000
FRAME_BYTES = 2048 * 2  # one SNAC frame of PCM16: the server writes whole frames
SPEECH = {"voice": "tara", "max_tokens": 28, "seed": 5}  # a few frames: quick on a CPU
TEXT = {"max_tokens": 6, "seed": 3, "ignore_eos": True}


@contextmanager
def served(model: str) -> Iterator[str]:
    """`model` served on 127.0.0.1 from a loop in a thread of its own, yielding the base URL."""
    loop = asyncio.new_event_loop()
    url: concurrent.futures.Future[str] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with running_engine(model) as engine, serving(engine) as base:
                url.set_result(base)
                await stop.wait()
        except BaseException as e:
            if not url.done():
                url.set_exception(e)
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        yield url.result(timeout=120)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="module")
def text_url() -> Iterator[str]:
    with served("tiny-llama") as url:
        yield url


@pytest.fixture(scope="module")
def speech_url() -> Iterator[str]:
    with served("orpheus-tiny") as url:
        yield url


@pytest.fixture(scope="module")
def client(text_url: str) -> Iterator[Client]:
    with Client(text_url) as c:
        yield c


def streamed_text(chunks: list[Completion]) -> str:
    return "".join(c.text for c in chunks if c.choices)


# ---------------------------------------------------------------- text, blocking


def test_health_models_metrics(client: Client) -> None:
    health = client.health()
    assert health.ok and health.model == "tiny-llama" and health.raw["devices"][0]["alive"]
    [card] = client.models()
    assert card.id == "tiny-llama" and card.owned_by == "mstar" and card.max_model_len and card.max_model_len > 0
    metrics = client.metrics()
    assert "# TYPE" in metrics and "mstar_" in metrics


def test_completions_whole_and_streamed(client: Client) -> None:
    whole = client.completions("Hello", **TEXT)
    assert whole.object == "text_completion" and whole.model == "tiny-llama"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert whole.choices[0].finish_reason == "length"
    with client.completions("Hello", stream=True, include_usage=True, **TEXT) as stream:
        chunks = list(stream)
    # a seeded request draws the same tokens streamed or not
    assert streamed_text(chunks) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_logprobs_reach_the_choices(client: Client) -> None:
    whole = client.completions("Hello", logprobs=2, **TEXT)
    assert len(whole.choices[0].logprobs["token_logprobs"]) == 6
    chat = client.chat([{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=1, **TEXT)
    entries = chat.choices[0].logprobs["content"]
    assert len(entries) == 6 and all(len(e["top_logprobs"]) == 1 and e["logprob"] <= 0 for e in entries)


def test_chat_whole_and_streamed(client: Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat(messages, **TEXT)
    assert whole.object == "chat.completion" and whole.choices[0].role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = list(client.chat(messages, stream=True, **TEXT))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].role == "assistant"
    assert streamed_text(chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_generate_whole_and_streamed(client: Client) -> None:
    whole = client.generate("Hi", **TEXT)
    assert whole.finished and whole.finish_reason == "length" and len(whole.token_ids) == 6
    assert whole.audio is None and whole.request_id.startswith("gen-")
    lines = list(client.generate("Hi", stream=True, **TEXT))
    assert [t for line in lines for t in line.token_ids] == whole.token_ids
    assert "".join(line.text for line in lines) == whole.text
    assert [line.finished for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1].usage == whole.usage and lines[-1].finish_reason == "length"
    by_ids = client.generate(input_ids=whole.token_ids[:3], max_tokens=2)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 3


def test_errors_name_the_field(client: Client) -> None:
    with pytest.raises(MstarError) as bad:
        client.completions("Hi", max_tokens=0)
    assert bad.value.status == 400 and bad.value.param == "max_tokens" and "at least 1" in bad.value.message
    assert bad.value.type == "invalid_request_error" and not bad.value.retryable
    with pytest.raises(MstarError) as missing:
        client.chat([{"role": "user", "content": "Hi"}], model="no-such-model", stream=True)
    assert (missing.value.status, missing.value.code, missing.value.param) == (404, "model_not_found", "model")


def test_connection_refused_is_an_mstar_error() -> None:
    with Client("http://127.0.0.1:9", timeout=5) as c, pytest.raises(MstarError) as refused:
        c.health()
    assert refused.value.status is None and refused.value.code == "connection_error"


def test_imports_and_works_without_torch(text_url: str) -> None:
    script = f"""
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, NoTorch())
from mstar.client import Client
with Client({text_url!r}) as c:
    assert c.health().ok
    print(c.completions("Hi", max_tokens=3, ignore_eos=True).usage.completion_tokens)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


# ---------------------------------------------------------------- text, async


async def test_async_client_whole_and_streamed(text_url: str) -> None:
    async with AsyncClient(text_url) as c:
        assert (await c.health()).ok
        whole = await c.completions("Hello", **TEXT)
        stream = await c.completions("Hello", stream=True, **TEXT)
        chunks = [chunk async for chunk in stream]
        assert streamed_text(chunks) == whole.text and chunks[-1].choices[0].finish_reason == "length"
        chat = await c.chat([{"role": "user", "content": "Hi"}], stream=True, **TEXT)
        async with chat:
            first = await chat.__anext__()
        assert first.choices[0].role == "assistant"  # closing after one chunk aborts the rest
        generated = await c.generate("Hi", **TEXT)
        lines = [line async for line in await c.generate("Hi", stream=True, **TEXT)]
        assert [t for line in lines for t in line.token_ids] == generated.token_ids
        with pytest.raises(MstarError) as bad:
            await c.generate("Hi", temperature=-1.0)
        assert bad.value.status == 400 and bad.value.param == "sampling_params.temperature"


async def test_blocking_client_inside_a_running_loop(text_url: str) -> None:
    """What a Jupyter cell does: call the blocking client while a loop runs in this thread."""
    assert asyncio.get_running_loop().is_running()
    with Client(text_url) as c:
        whole = c.completions("Hello", **TEXT)
        assert streamed_text(list(c.completions("Hello", stream=True, **TEXT))) == whole.text
    assert whole.usage is not None and whole.usage.completion_tokens == 6


def wait_idle(client: Client, timeout: float = 5.0) -> int:
    """The server's running requests once none are left, or as they are at `timeout`."""
    deadline = time.monotonic() + timeout
    while (running := client.health().requests_running) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def test_a_stream_left_unclosed_frees_the_servers_request(text_url: str, speech_url: str) -> None:
    """A bare `break` out of a stream, the stream then dropped: the server
    stops generating for it, without waiting for the client to close."""
    with Client(text_url) as text, Client(speech_url) as speech:
        chunks = text.completions("Hi", stream=True, max_tokens=1900, ignore_eos=True)
        for chunk in chunks:
            break
        audio = speech.speech("A long sentence that nobody listens to.", voice="tara", max_tokens=1200)
        for pcm in audio:
            break
        assert text.health().requests_running == 1 and speech.health().requests_running == 1
        del chunks, chunk, audio, pcm
        gc.collect()
        assert (wait_idle(text), wait_idle(speech)) == (0, 0)


# ---------------------------------------------------------------- speech


def test_speech_streams_pcm_and_writes_wav(speech_url: str, tmp_path: Path) -> None:
    with Client(speech_url) as c:
        stream = c.speech("Hello from mstar.", **SPEECH)
        chunks = list(stream)
        speech = stream.collect()
    assert len(chunks) >= 2 and all(len(chunk) % FRAME_BYTES == 0 for chunk in chunks)
    assert speech.pcm == b"".join(chunks) and speech.sample_rate == RATE and speech.channels == 1
    assert speech.ttfa is not None and 0 < speech.ttfa <= speech.elapsed
    assert speech.duration == len(speech.pcm) / 2 / RATE
    buffer = io.BytesIO()
    speech.to_wav(buffer)
    speech.to_wav(tmp_path / "hello.wav")
    assert (tmp_path / "hello.wav").read_bytes() == buffer.getvalue()
    buffer.seek(0)
    with wave.open(buffer, "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, RATE)
        assert wav.getnframes() == len(speech.pcm) // 2 == speech.num_samples
        assert wav.readframes(wav.getnframes()) == speech.pcm


async def test_async_speech_wav_stream_gives_the_same_pcm(speech_url: str) -> None:
    async with AsyncClient(speech_url) as c:
        pcm = await c.speech("Hello from mstar.", stream=False, **SPEECH)
        wav = await c.speech("Hello from mstar.", response_format="wav", stream=False, **SPEECH)
        with pytest.raises(MstarError) as bad:
            await c.speech(" ", voice="tara")
    # the WAV stream's header is read off: what is left is the same seeded audio
    assert wav.format == "wav" and wav.sample_rate == RATE and wav.pcm == pcm.pcm and len(pcm.pcm) > 0
    assert bad.value.status == 400 and bad.value.param == "input"


async def test_whole_speech_is_the_servers_file_with_true_sizes(speech_url: str) -> None:
    """`stream=False` asks the server for one file: a streamed FLAC says its
    sample count is unknown, which soundfile cannot read."""
    soundfile = pytest.importorskip("soundfile")
    async with AsyncClient(speech_url) as c:
        pcm = await c.speech("Hello from mstar.", stream=False, **SPEECH)
        flac = await c.speech("Hello from mstar.", response_format="flac", stream=False, **SPEECH)
    info = soundfile.info(io.BytesIO(flac.audio))
    assert (info.samplerate, info.frames) == (RATE, len(pcm.pcm) // 2) and len(pcm.pcm) > 0
    samples, _ = soundfile.read(io.BytesIO(flac.audio), dtype="int16")
    assert samples.tobytes() == pcm.pcm  # lossless: the same seeded audio


# ---------------------------------------------------------------- a stub server


@pytest.fixture
async def stub() -> AsyncIterator[tuple[str, list[float]]]:
    """429 with Retry-After 0.2 until the third call of /health; a stream that
    fails after one chunk on /v1/completions. Yields the URL and call times."""
    calls: list[float] = []

    async def health(request: web.Request) -> web.Response:
        calls.append(time.perf_counter())
        if len(calls) < 3:
            return web.json_response({"error": {"message": "busy", "type": "requests", "param": None,
                                                "code": "queue_full"}}, status=429,
                                     headers={"Retry-After": "0.2"})
        return web.json_response({"status": "ok", "model": "stub", "requests_running": 0})

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}'
                             b'\n\ndata: {"error": {"message": "the request ran past its limit", '
                             b'"type": "server_error", "param": null, "code": "timeout"}}\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    async with serving_app(app) as url:
        yield url, calls


async def test_retries_honour_retry_after(stub: tuple[str, list[float]]) -> None:
    url, calls = stub
    async with AsyncClient(url, max_retries=1) as once:
        with pytest.raises(MstarError) as busy:
            await once.health()
    assert (busy.value.status, busy.value.code, busy.value.retry_after) == (429, "queue_full", 0.2)
    assert busy.value.retryable and len(calls) == 2 and calls[1] - calls[0] >= 0.2
    async with AsyncClient(url, max_retries=2) as patient:
        assert (await patient.health()).ok and len(calls) == 3


async def test_error_event_mid_stream_raises(stub: tuple[str, list[float]]) -> None:
    url, _ = stub
    async with AsyncClient(url) as c:
        stream = await c.completions("Hi", stream=True)
        assert (await stream.__anext__()).text == "a"
        with pytest.raises(MstarError) as cut:
            await stream.__anext__()
    assert (cut.value.status, cut.value.code, cut.value.type) == (None, "timeout", "server_error")


def test_realtime_session_speaks_cancels_and_reports_errors(speech_url: str, tmp_path: Path) -> None:
    with Client(speech_url) as client, client.realtime("orpheus-tiny", voice="leo", max_output_tokens=35,
                                                       input_linger_ms=0, seed=3) as rt:
        assert rt.session["audio"]["output"]["voice"] == "leo"
        reply = rt.speak("hello from the sdk")
        assert reply.status == "incomplete" and reply.transcript == "hello from the sdk"  # cut at 35 tokens
        # at most four frames (random weights write a non-audio id now and then), whole ones
        assert 0 < len(reply.audio) <= 4 * 2048 * 2 and len(reply.audio) % 4096 == 0
        assert reply.first_delta_s is not None
        assert reply.usage["output_tokens"] == 35
        reply.to_wav(tmp_path / "rt.wav")
        with wave.open(str(tmp_path / "rt.wav"), "rb") as w:
            assert w.getframerate() == 24_000 and w.getnframes() == len(reply.audio) // 2
        with pytest.raises(MstarError) as e:
            rt.cancel()
            rt.reply()
        assert e.value.code == "response_cancel_not_active"
        rt.update(max_output_tokens=1000)
        rt.say("a long one")
        rt.respond()
        for ev in rt.events():
            if ev["type"] == "response.output_audio.delta":
                rt.cancel()
                break
        assert rt.reply().status == "cancelled"


async def test_async_realtime_refuses_an_unknown_model(speech_url: str) -> None:
    async with AsyncClient(speech_url) as client:
        with pytest.raises(MstarError) as e:
            await client.realtime("no-such-model")
        # the refused upgrade's own body, as an HTTP call's: not just its status
        assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
        assert "no-such-model" in e.value.message


async def test_a_refusal_read_later_names_the_event_it_refused(speech_url: str) -> None:
    """Appends on a model that does not hear are refused by error events the
    next read raises (here `update`'s wait): the error names the append, not
    the update, and the session goes on."""
    async with AsyncClient(speech_url) as client, await client.realtime("orpheus-tiny") as rt:
        await rt.append_audio(b"\0\0" * 2400)
        with pytest.raises(MstarError) as e:
            await rt.update(voice="leo")
        assert e.value.event_type == "input_audio_buffer.append" and e.value.event_id is not None
        assert e.value.code == "audio_input_not_supported" and "input_audio_buffer.append" in str(e.value)
        assert (await rt.until("session.updated"))["session"]["audio"]["output"]["voice"] == "leo"


async def test_speak_that_reads_an_earlier_refusal_ends_its_own_response_first(speech_url: str) -> None:
    """`speak` raises a refusal of an earlier event read on the way, having cancelled and read out the
    response it started: the next `speak` gets its own answer, not a refusal or the leftover response's."""
    async with AsyncClient(speech_url) as client, \
            await client.realtime("orpheus-tiny", max_output_tokens=35, input_linger_ms=0, seed=3) as rt:
        await rt.append_audio(b"\0\0" * 2400)  # refused later: this model does not hear
        with pytest.raises(MstarError) as e:
            await rt.speak("First sentence.")
        assert e.value.event_type == "input_audio_buffer.append" and e.value.code == "audio_input_not_supported"
        second = await rt.speak("Second sentence.")
        assert second.transcript == "Second sentence." and second.status in ("completed", "incomplete")
        third = await rt.speak("Third one.")
        assert third.transcript == "Third one." and third.response_id != second.response_id
        # the same with a response.create the server refuses too: nothing started, so nothing is left to end,
        # and neither that refusal nor the one of the cancel sent to end it reaches the next call
        await rt.append_audio(b"\0\0" * 2400)
        with pytest.raises(MstarError) as e:
            await rt.speak("Fourth.", max_output_tokens=-3)
        assert e.value.event_type == "input_audio_buffer.append"
        fifth = await asyncio.wait_for(rt.speak("Fifth."), 60)
        assert fifth.transcript.endswith("Fifth.") and fifth.status in ("completed", "incomplete")


def test_an_error_event_of_a_429s_type_is_retryable_as_the_429() -> None:
    """A realtime `error` event has no status: its type says the server was
    busy (`requests`, what a 429 answer carries), so it is worth sending again."""
    assert MstarError("busy", code="queue_full", type="requests").retryable
    assert not MstarError("bad", code="invalid_value", type="invalid_request_error").retryable
    assert not MstarError("bad", status=400, type="requests").retryable  # an answer's status decides
