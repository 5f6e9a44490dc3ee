"""Fixtures shared by the HTTP tests: one running tiny-llama engine and one
server in front of it per test module, and a client session per test. Without
a GPU, Triton's interpreter is switched on for the kernel tests."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

# Triton kernels run on CPU tensors through its interpreter, which must be on
# before any @triton.jit decorator runs, i.e. before mstar.kernels is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture
def exact_float32() -> Iterator[None]:
    """CUDA float32 without TF32 (cuDNN's convolutions default to it), for
    tests that hold a GPU path to a CPU float32 reference."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
