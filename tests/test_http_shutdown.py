"""SIGTERM while long speech streams run: the server stops listening, lets them
run for the drain time, then ends each with an error event (not a cut) and
exits 0 within its grace."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import orjson
import pytest
from test_http_main import start_server, wait_for_line

from mstar.http.__main__ import SHUTDOWN_GRACE_S

LONG_SPEECH = {"model": "orpheus-tiny", "input": "A long story. " * 10, "voice": "tara", "response_format": "pcm",
               "stream_format": "sse", "max_tokens": 1500, "ignore_eos": True, "seed": 3}


async def _events(response: aiohttp.ClientResponse, first: asyncio.Event) -> list[dict]:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append(orjson.loads(line[len(b"data: "):]))
            first.set()
    return events


async def test_sigterm_ends_long_speech_streams_with_an_error_event_within_the_grace() -> None:
    proc = start_server("--model", "orpheus-tiny")
    try:
        url = await asyncio.to_thread(wait_for_line, proc, "listening")
        url = url["url"]
        async with aiohttp.ClientSession() as http:
            responses = [await http.post(url + "/v1/audio/speech", json=LONG_SPEECH) for _ in range(2)]
            assert all(r.status == 200 for r in responses)
            started = [asyncio.Event() for _ in responses]
            readers = [asyncio.ensure_future(_events(r, e)) for r, e in zip(responses, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as pooled:
                async with pooled.get(url + "/health") as r:  # its connection stays open, kept alive
                    assert r.status == 200
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)
                # a request on the kept-alive connection while the server drains: refused at once (the idle
                # connection was closed, the listener is gone), not held until the drain ends
                sent = time.monotonic()
                with pytest.raises(aiohttp.ClientError):
                    async with pooled.get(url + "/health", timeout=aiohttp.ClientTimeout(total=20)) as r:
                        await r.read()
                assert time.monotonic() - sent < 2, "a request on a kept-alive connection waited for the drain"
            streams = await asyncio.wait_for(asyncio.gather(*readers), timeout=SHUTDOWN_GRACE_S + 20)
            code = await asyncio.to_thread(proc.wait, SHUTDOWN_GRACE_S + 20)
            took = time.monotonic() - t0
        assert code == 0
        assert took < SHUTDOWN_GRACE_S + 5, f"exited {took:.1f} s after SIGTERM"  # the grace, and a busy box
        for events in streams:
            assert any(e.get("type") == "speech.audio.delta" for e in events)
            last = events[-1]
            assert last["type"] == "error" and last["error"]["code"] == "aborted", last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_sigterm_ends_a_realtime_response_then_closes_the_socket_going_away() -> None:
    proc = start_server("--model", "orpheus-tiny")
    try:
        url = (await asyncio.to_thread(wait_for_line, proc, "listening"))["url"]
        async with aiohttp.ClientSession() as http, http.ws_connect(url + "/v1/realtime") as ws:
            await ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "A long story. " * 10}]}})
            await ws.send_json({"type": "response.create", "response": {"max_output_tokens": 1500}})
            kinds = []
            async for msg in ws:
                event = orjson.loads(msg.data)
                kinds.append(event["type"])
                if event["type"] == "response.output_audio.delta" and kinds.count(event["type"]) == 1:
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(wait_for_line, proc, "stop signal received; draining")
                    await asyncio.sleep(0.5)
                    cancelled_at = time.monotonic()
                    await ws.send_json({"type": "response.cancel"})  # heard during the drain, not dropped
                if event["type"] == "response.done":
                    done, done_at = event, time.monotonic()
            code = ws.close_code
        assert await asyncio.to_thread(proc.wait, SHUTDOWN_GRACE_S + 20) == 0
        assert kinds.count("response.done") == 1, (kinds[-5:], code)  # its last events, before the close
        assert done["response"]["status"] in ("cancelled", "failed")
        assert done_at - cancelled_at < 3, "the cancel sent during the drain waited for its end"
        assert code == aiohttp.WSCloseCode.GOING_AWAY
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_sigterm_lets_a_request_whose_body_is_arriving_finish_within_the_drain() -> None:
    """The drain waited for the engine's requests only: one still uploading its body had none yet, so its
    connection was closed at once (1.5 s, 3 s before) with no answer, well within the 7 s it promises."""
    proc = start_server()
    try:
        url = (await asyncio.to_thread(wait_for_line, proc, "listening"))["url"]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = orjson.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2})
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5]))
        await writer.drain()
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_for_line, proc, "stop signal received; draining")
        await asyncio.sleep(3.5)  # past what aiohttp gave it, within the drain
        writer.write(body[5:])
        answer = await asyncio.wait_for(reader.read(65536), 20)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert await asyncio.to_thread(proc.wait, SHUTDOWN_GRACE_S + 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
