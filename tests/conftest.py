"""Fixtures shared by the HTTP tests: one running tiny-llama engine and one
server in front of it per test module, and a client session per test."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helper modules by name

from http_support import running_engine, serving  # noqa: E402

from mstar.engine.engine import Engine  # noqa: E402


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine() -> AsyncIterator[Engine]:
    async with running_engine() as e:
        yield e


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine: Engine) -> AsyncIterator[str]:
    async with serving(engine) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def http(server: str) -> AsyncIterator["aiohttp.ClientSession"]:  # noqa: F821
    import aiohttp

    async with aiohttp.ClientSession(base_url=server) as session:
        yield session
