"""Requests that never finish arriving, over raw loopback sockets: a header
block that stops (or trickles) is closed at --header-timeout, a body that
stops (or trickles) gets a 408 at --body-timeout and the connection closes,
while a normal request, an idle keep-alive connection and text streamed into
speech (only its pauses are bounded) go on as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager, suppress
from typing import Any

import orjson
import pytest
import pytest_asyncio
from http_support import running_engine
from aiohttp import web

from mstar.config import ServerConfig
from mstar.engine.engine import Engine
from mstar.http.deadlines import ServingRunner
from mstar.http.server import build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

HEAD_S = 0.5
BODY_S = 1.0
SLACK_S = 1.5  # the loop is shared with an engine on a busy CPU
COMPLETION = orjson.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2})


@asynccontextmanager
async def serve(engine: Engine, **config: float) -> AsyncIterator[tuple[str, int]]:
    app = build_app(engine, manage_engine=False, config=ServerConfig(**config))
    runner = ServingRunner(app, header_timeout=config.get("header_timeout", HEAD_S), handler_cancellation=True,
                           access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][:2]
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def address(engine: Engine) -> AsyncIterator[tuple[str, int]]:
    async with serve(engine, header_timeout=HEAD_S, body_timeout=BODY_S) as addr:
        yield addr


async def read_until_closed(reader: asyncio.StreamReader, limit: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start = time.monotonic()
    got = b""
    with suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(65536), limit):
            got += chunk
    return got, time.monotonic() - start


async def read_while_sending(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             sending: Coroutine[Any, Any, None]) -> tuple[bytes, float]:
    """`read_until_closed` while `sending` keeps writing; both end with the connection."""
    sender = asyncio.get_running_loop().create_task(sending)
    try:
        return await read_until_closed(reader)
    finally:
        sender.cancel()
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        if int(size, 16) == 0:
            return out
        out, body = out + body[:int(size, 16)], body[int(size, 16) + 2:]


def body_of(answer: bytes) -> dict:
    return orjson.loads(answer.split(b"\r\n\r\n", 1)[1])


async def test_an_unfinished_header_block_is_closed_with_408(address) -> None:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    answer, took = await read_until_closed(reader)
    writer.close()
    assert took < HEAD_S + SLACK_S
    assert status_of(answer) == 408 and b"Connection: close" in answer
    assert body_of(answer)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("raw", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-" + b"a" * 9000 + b"\r\n\r\n",
    b"GARBAGE\r\n\r\n",
])
async def test_a_malformed_head_is_a_json_400_without_an_error_traceback(
        address, raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp answered these in text/plain and logged each at error level with a traceback: a client's
    mistake (or a scanner) raised the server's alarms."""
    reader, writer = await asyncio.open_connection(*address)
    with caplog.at_level("INFO"):
        writer.write(raw)
        answer, _ = await read_until_closed(reader)
    writer.close()
    assert status_of(answer) == 400 and b"Content-Type: application/json" in answer
    error = body_of(answer)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_request" and error["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info]
    assert "sk-aaa" not in caplog.text  # the message quotes the header: the log line must not


async def test_a_trickled_header_block_is_closed_at_its_deadline(address) -> None:
    reader, writer = await asyncio.open_connection(*address)

    async def trickle() -> None:
        writer.write(b"GET /health HTTP/1.1\r\n")
        while True:  # a header line every tenth of a second, never the blank line
            await asyncio.sleep(0.1)
            writer.write(b"X-Slow: 1\r\n")

    answer, took = await read_while_sending(reader, writer, trickle())
    assert took < HEAD_S + SLACK_S
    assert status_of(answer) == 408


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(address) -> None:
    reader, writer = await asyncio.open_connection(*address)
    answer, took = await read_until_closed(reader)
    writer.close()
    assert answer == b"" and took < HEAD_S + SLACK_S


async def test_an_unfinished_chunked_body_gets_408_and_the_connection_closes(address) -> None:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
    answer, took = await read_until_closed(reader)
    writer.close()
    assert BODY_S * 0.9 < took < BODY_S + SLACK_S
    assert status_of(answer) == 408 and b"Connection: close" in answer
    error = body_of(answer)["error"]
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]


async def test_an_endless_trickled_body_is_cut_at_its_deadline(address) -> None:
    reader, writer = await asyncio.open_connection(*address)

    async def endless() -> None:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        while not writer.is_closing():
            writer.write(b"1\r\n \r\n")
            await asyncio.sleep(0.05)

    answer, took = await read_while_sending(reader, writer, endless())
    assert took < BODY_S + SLACK_S
    # the client keeps sending into a closed connection, so a reset may beat the answer to it
    assert answer == b"" or status_of(answer) == 408


async def test_a_normal_request_and_an_idle_keep_alive_connection_are_unaffected(address) -> None:
    reader, writer = await asyncio.open_connection(*address)
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(COMPLETION))
    for pause in (0.0, HEAD_S + 0.3):  # idle between requests longer than the head deadline
        if pause:
            writer.write(b"\r\n")  # a stray CRLF after an answer is no head (RFC 9112): nothing times it
        await asyncio.sleep(pause)
        writer.write(request)
        await asyncio.sleep(0.2)  # the body comes a little after its head, well within its deadline
        writer.write(COMPLETION)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert status_of(head) == 200, head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        assert orjson.loads(await reader.readexactly(length))["object"] == "text_completion"
    writer.close()


async def test_no_deadlines_when_both_are_zero(engine: Engine) -> None:
    async with serve(engine, header_timeout=0, body_timeout=0) as addr:
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{")
        with pytest.raises(TimeoutError):  # nothing comes back while the body is still due
            await asyncio.wait_for(reader.read(1), HEAD_S + BODY_S)
        writer.write(b"}   ")
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert status_of(answer) == 400  # the body arrived late, but whole: it is read and judged
        writer.close()


# ------------------------------------------------------------ streamed in

SPEECH = {"model": "orpheus-tiny", "voice": "tara", "response_format": "pcm", "max_tokens": 14,
          "ignore_eos": True, "seed": 3}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def speaker() -> AsyncIterator[tuple[str, int]]:
    async with running_engine("orpheus-tiny") as engine, serve(engine, header_timeout=HEAD_S,
                                                                body_timeout=BODY_S) as addr:
        yield addr


async def _speech(address: tuple[str, int], lines: list[tuple[float, bytes]],
                  ) -> tuple[bytes, float, asyncio.Task[None]]:
    """A chunked NDJSON body, each line after its pause; the whole answer and
    how long it took to close."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")

    async def send() -> None:
        for pause, line in lines:
            await asyncio.sleep(pause)
            writer.write(b"%x\r\n%s\r\n" % (len(line), line))
        writer.write(b"0\r\n\r\n")

    sender = asyncio.get_running_loop().create_task(send())
    try:
        answer, took = await read_until_closed(reader, limit=60)
    finally:
        writer.close()
    return answer, took, sender


async def test_text_streamed_in_with_pauses_is_not_held_to_the_whole_body_deadline(speaker) -> None:
    lines = [(0.0, orjson.dumps({**SPEECH, "input": "one.", "stream_format": "sse"}) + b"\n")]
    lines += [(BODY_S * 0.4, orjson.dumps({"input": f"more {i}."}) + b"\n") for i in range(5)]
    reader, writer = await asyncio.open_connection(*speaker)
    writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    started = time.monotonic()
    for pause, line in lines:  # 2 s of body against a 1 s whole-body deadline
        await asyncio.sleep(pause)
        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
    writer.write(b"0\r\n\r\n")
    assert time.monotonic() - started > BODY_S
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    assert status_of(head) == 200 and b"chunked" in head.lower()
    body = b""
    while not body.endswith(b"0\r\n\r\n"):  # the chunked events to their end
        body += await asyncio.wait_for(reader.read(65536), 60)
    writer.close()
    done = orjson.loads(dechunk(body).rstrip().rsplit(b"\n\n", 1)[1][len(b"data: "):])
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["output_tokens"] == len(lines) * SPEECH["max_tokens"]  # every line was spoken


async def test_a_pause_past_the_deadline_ends_the_streamed_input(speaker) -> None:
    first = orjson.dumps({**SPEECH, "input": "one."}) + b"\n"
    late = orjson.dumps({"input": "never spoken."}) + b"\n"
    answer, took, sender = await _speech(speaker, [(0.0, first), (BODY_S + SLACK_S + 3.0, late)])
    sender.cancel()
    with suppress(asyncio.CancelledError):
        await sender
    # the input ended at the idle deadline: the first turn is spoken to the end, then the connection closes
    assert took < BODY_S + SLACK_S + 3.0
    assert status_of(answer) == 200 and answer.endswith(b"0\r\n\r\n")


async def test_shutdown_cancels_a_stuck_handler_within_the_runners_timeout() -> None:
    """A handler stuck in a write to a client that stopped reading: aiohttp waited the shutdown timeout for
    it, then as long again after cancelling only the request's body (which it never reads), so the process
    exited 13 s after SIGTERM instead of within its 10 s grace."""
    stuck = asyncio.Event()

    async def never_ends(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        stuck.set()
        await asyncio.Event().wait()  # as a write that never drains
        return response

    app = web.Application()
    app.router.add_get("/", never_ends)
    runner = ServingRunner(app, header_timeout=HEAD_S, handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    reader, writer = await asyncio.open_connection(*runner.addresses[0][:2])
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(stuck.wait(), 10)
        start = time.monotonic()
        await runner.cleanup()
        assert time.monotonic() - start < 1.0 + 0.5
    finally:
        writer.close()
