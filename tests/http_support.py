"""What the HTTP tests share: a real engine (tiny-llama unless told) behind the
aiohttp app on a loopback port, and readers for SSE and NDJSON bodies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.http.server import build_app

if TYPE_CHECKING:  # the GPU machine's image has no openai; only the tests that use the client need it
    import openai

MODEL = "tiny-llama"


@asynccontextmanager
async def running_engine(model: str = MODEL, max_model_len: int | None = None,
                         config: EngineConfig | None = None) -> AsyncIterator[Engine]:
    """A started engine of `model` (or of the whole `config`), shut down on the way out."""
    engine = Engine(config or EngineConfig(model=model, max_model_len=max_model_len))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


@asynccontextmanager
async def serving(engine: Engine, cancel_handlers: bool = True) -> AsyncIterator[str]:
    """The app on 127.0.0.1:<free port>, yielding its base URL; the test owns
    the engine's lifetime. With `cancel_handlers` a client that hangs up
    cancels its handler, as under `__main__`; without, only a failed write
    tells the handler."""
    async with serving_app(build_app(engine, manage_engine=False), handler_cancellation=cancel_handlers,
                           access_log=None, shutdown_timeout=1.0) as url:
        yield url


@asynccontextmanager
async def openai_client(config: EngineConfig) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official `openai` client (no retries) against a fresh engine of
    `config`, served on a loopback port."""
    import openai

    engine = Engine(config)
    await engine.start()
    try:
        async with serving(engine) as base:
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
            yield api
            await api.close()
    finally:
        await engine.shutdown()


@asynccontextmanager
async def serving_app(app: web.Application, **runner_args: Any) -> AsyncIterator[str]:
    """Any aiohttp app (a stub server, say) on 127.0.0.1:<free port>, yielding its base URL."""
    runner = web.AppRunner(app, **runner_args)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """Every `data:` event decoded; the final `[DONE]` as the string itself."""
    events: list[Any] = []
    raw = (await response.read()).decode()
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def read_ndjson(response: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    raw = await response.read()
    return [orjson.loads(line) for line in raw.splitlines() if line.strip()]


async def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()
