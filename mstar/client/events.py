"""A streamed body's bytes in, decoded JSON events out: server-sent events
(`data: {...}` frames ending with `data: [DONE]`) and NDJSON lines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, without their ends. Split here rather than by the
    reader's `readline`, which refuses lines longer than its buffer (an NDJSON
    line with a long piece of base64 audio can be)."""
    buffer = bytearray()
    async for data in content.iter_any():
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            yield bytes(buffer[start:end]).rstrip(b"\r")
            start = end + 1
        del buffer[:start]
    if buffer.strip():
        yield bytes(buffer)


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """Each event's `data` decoded, until `[DONE]` or the end of the body."""
    data: list[bytes] = []
    async for line in lines(content):
        if line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
        elif not line and data:
            payload = b"\n".join(data)
            data.clear()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
        # comments (": ...") and other fields (event, id, retry) carry nothing we use
    if data and data != [b"[DONE]"]:
        yield json.loads(b"\n".join(data))


async def ndjson_events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    async for line in lines(content):
        if line.strip():
            yield json.loads(line)
