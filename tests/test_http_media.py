"""The media front (`mstar.http.media`): decodes run in spawned processes and
give what the functions give in-process, errors come back naming their field
(as a 400 through the app), a crashed decoder is replaced, the app's cleanup
stops the pool, and the event loop runs on while a minute of audio and a 4k
image decode in the pool (where decoding them on the loop stalls it)."""

from __future__ import annotations

import asyncio
import base64
import io
import multiprocessing
import os
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import aiohttp
import media_fns
import numpy as np
import pytest
import soundfile as sf
from aiohttp import web
from http_support import serving_app, wait_until
from media_fns import Hold
from PIL import Image
from test_layering import _import_without_torch

from mstar import config
from mstar.config import ServerConfig, parse_args
from mstar.engine.eventloop.metrics import LagMonitor
from mstar.errors import ConfigError, RequestError
from mstar.http.keys import MEDIA
from mstar.http.media import AUDIO_FORMATS, Decoders, MediaDecoder, audio_format
from mstar.http.server import build_app
from mstar.models import media

AUDIO = "messages[0].content[1].input_audio.data"
IMAGE = "messages[0].content[2].image_url.url"
T = TypeVar("T")


@pytest.fixture(scope="module")
def decoder() -> Iterator[MediaDecoder]:
    d = MediaDecoder(1)
    yield d
    asyncio.run(d.close())


def wav_b64(seconds: float, rate: int, channels: int) -> str:
    t = np.arange(round(seconds * rate)) / rate
    x = np.stack([0.5 * np.sin(2 * np.pi * (300 + 200 * c) * t) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def png_url(height: int, width: int) -> str:
    # a gradient with noise: compresses like a photo, not like a flat colour
    noise = np.random.default_rng(0).integers(0, 36, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise + np.linspace(0, 219, width).astype(np.uint8)[None, :, None]).save(
        buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_decodes_match_the_functions_in_process(decoder: MediaDecoder) -> None:
    data, url = wav_b64(1.5, 44100, 2), png_url(30, 40)
    got = await decoder.audio(data, AUDIO, max_seconds=2)
    assert np.array_equal(got, media.audio_from_base64(data, AUDIO, max_seconds=2))
    got = await decoder.audio(data, AUDIO, max_seconds=2, rate=24000)
    assert got.shape == (36000,)
    got = await decoder.image(url, IMAGE, max_pixels=10_000)
    assert np.array_equal(got, media.image_from_data_url(url, IMAGE, max_pixels=10_000))


async def test_refusals_come_back_naming_their_field(decoder: MediaDecoder) -> None:
    with pytest.raises(RequestError) as e:
        await decoder.audio(wav_b64(3.0, 16000, 1), AUDIO, max_seconds=2)
    assert (e.value.field, e.value.status) == (AUDIO, 400) and "longer than the 2 s" in e.value.message
    with pytest.raises(RequestError) as e:
        await decoder.image("https://example.com/a.png", IMAGE, max_pixels=100)
    assert e.value.field == IMAGE and "does not fetch" in e.value.message
    with pytest.raises(RequestError) as e:
        await decoder.image(png_url(30, 40), IMAGE, max_pixels=1000)
    assert e.value.field == IMAGE and "30" in e.value.message
    with pytest.raises(RequestError) as e:
        await decoder.audio(None, AUDIO, max_seconds=1)  # type: ignore[arg-type]
    assert e.value.field == AUDIO


@pytest.mark.parametrize("module", ("mstar.models.media", "mstar.http.media"))
def test_the_decoders_load_without_torch(module: str) -> None:
    # every pool process imports them: torch would cost each one seconds and hundreds of MB
    result = _import_without_torch(module)
    assert result.returncode == 0, result.stderr


def test_declared_audio_formats() -> None:
    assert AUDIO_FORMATS == media.AUDIO_FORMATS  # what the front lets through, the decoder reads
    assert audio_format("MP3", "x.format") == "mp3"
    for bad in ("aac", None, 3):
        with pytest.raises(RequestError) as e:
            audio_format(bad, "messages[0].content[1].input_audio.format")
        assert e.value.field == "messages[0].content[1].input_audio.format"


async def test_a_crashed_decoder_is_replaced() -> None:
    d = MediaDecoder(1, Decoders(audio=media_fns.audio, image=media_fns.image))
    try:
        with pytest.raises(RequestError) as e:  # it kills the pool, and the new one it is tried again on
            await d.audio("die", AUDIO, max_seconds=1)
        assert e.value.field == AUDIO and "died" in e.value.message
        assert (await d.audio("four", AUDIO, max_seconds=1)).tolist() == [4.0] * 3
    finally:
        await d.close()
    with pytest.raises(RuntimeError, match="closed"):
        await d.audio("four", AUDIO, max_seconds=1)


def test_media_workers_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args(["--media-workers", "3"]).media_workers == 3
    with pytest.raises(ConfigError, match="--media-workers"):
        parse_args(["--media-workers", "0"])
    for cpus, workers in ((2, 1), (16, 2), (128, 16), (512, 16)):
        monkeypatch.setattr(config.os, "sched_getaffinity", lambda _, n=cpus: set(range(n)))
        assert config.default_media_workers() == workers
        assert parse_args([]).media_workers == workers


async def test_the_app_answers_400_naming_the_field_and_stops_the_pool_at_cleanup() -> None:
    app = build_app(object(), manage_engine=False, config=ServerConfig(media_workers=1))  # type: ignore[arg-type]

    async def decode(request: web.Request) -> web.Response:
        body = await request.json()
        image = await request.app[MEDIA].image(body["url"], IMAGE, max_pixels=10_000)
        return web.json_response({"shape": list(image.shape)})

    app.router.add_post("/decode", decode)
    before = set(multiprocessing.active_children())
    async with serving_app(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/decode", json={"url": png_url(20, 30)}) as r:
            assert r.status == 200 and await r.json() == {"shape": [20, 30, 3]}
        async with http.post(f"{url}/decode", json={"url": "data:image/png;base64,AAAA"}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == IMAGE and "not a PNG" in error["message"]
        spawned = set(multiprocessing.active_children()) - before
        assert spawned
    assert not any(p.is_alive() for p in spawned)


# ------------------------------------------------------------- the event loop's lag

class WorstLag:
    """Takes what `LagMonitor` samples (the lag /metrics reports), keeps the worst."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.samples = 0

    def observe(self, value: float) -> None:
        self.worst = max(self.worst, value)
        self.samples += 1


async def timed(work: Awaitable[T]) -> tuple[T, float, float]:
    """`work`'s result, its wall time, and the loop's worst lag meanwhile."""
    lag = WorstLag()
    monitor = LagMonitor(lag, interval=0.002)  # type: ignore[arg-type]
    monitor.start()
    await asyncio.sleep(0.01)  # a sample or two before, so one is due while the work runs
    start = time.perf_counter()
    try:
        result = await work
    finally:
        seconds = time.perf_counter() - start
        await asyncio.sleep(0.01)
        monitor.stop()
    assert lag.samples > 0
    return result, seconds, lag.worst


async def test_big_media_decodes_in_a_pool_process_while_the_loop_runs(tmp_path: Path) -> None:
    """Decoding on the loop stalls it for about the decode's length; through
    the pool, a decode held at its start in a pool process leaves the loop
    serving (a heartbeat on it keeps beating), and gives what decoding on
    the loop gives."""
    audio, image = wav_b64(60.0, 48000, 2), png_url(2160, 3840)  # 15 MB and 23 MB of base64

    async def on_the_loop() -> list[np.ndarray]:
        return [media.audio_from_base64(audio, AUDIO, max_seconds=60),
                media.image_from_data_url(image, IMAGE, max_pixels=3840 * 2160)]

    inline, inline_s, inline_lag = await timed(on_the_loop())
    report = f"inline: {inline_s:.3f} s, worst lag {inline_lag:.3f} s"
    print(report)
    # the probe sees a blocked loop: decoding inline stalls it for about the decode's length
    assert inline_lag > 0.5 * inline_s, report

    hold = Hold(tmp_path)
    decoder = MediaDecoder(1, Decoders(audio=hold(media.audio_from_base64), image=hold(media.image_from_data_url)))
    beats: list[float] = []

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(0.001)
            beats.append(time.perf_counter())

    beating = asyncio.create_task(heartbeat())
    pooled: list[np.ndarray] = []
    try:
        for decode in (lambda: decoder.audio(audio, AUDIO, max_seconds=60),
                       lambda: decoder.image(image, IMAGE, max_pixels=3840 * 2160)):
            decoding = asyncio.ensure_future(decode())
            try:
                [pid] = await hold.started(1, [decoding])
                assert pid != os.getpid()  # in a process of the pool's
                # while the decode is held, the loop runs on: were it decoding, nothing here would run
                before = len(beats)
                assert await wait_until(lambda: len(beats) >= before + 20, timeout=30), len(beats) - before
                assert not decoding.done() and hold.pids() == [pid], decoding  # still held
            finally:
                hold.release()
                done, _ = await asyncio.wait([decoding], timeout=60)
                assert done, "a released decode never ended"
            pooled.append(decoding.result())
            hold.reset()
    finally:
        beating.cancel()
        await decoder.close()
    assert pooled[0].shape == (960_000,) and pooled[1].shape == (2160, 3840, 3)
    assert all(np.array_equal(a, b) for a, b in zip(pooled, inline))
