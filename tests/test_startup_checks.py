"""What stops a server at startup, checked in-process: CUDA devices this
machine lacks, a worker whose device cannot be set (its error reaches the
engine instead of hanging its start), a model naming a walk it lacks to
serve an API, the URLs the server prints, and the listening socket's
backlog."""

from __future__ import annotations

import asyncio
import selectors
import socket
import time

import pytest
import torch
from aiohttp import web

from mstar.config import EngineConfig
from mstar.engine.eventloop.devices import check_devices
from mstar.engine.engine import Engine
from mstar.engine.movement.tensor_store import TensorStore
from mstar.engine.worker.device_worker import DeviceWorker
from mstar.errors import ConfigError, MstarError
from mstar.http import listener
from mstar.models.registry import load_model


def fake_cuda(monkeypatch: pytest.MonkeyPatch, available: bool, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cuda_device_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, available=False, count=0)
    check_devices(["cpu", "cpu:1"])
    with pytest.raises(ConfigError, match="CUDA is not available here; use --gpus cpu"):
        check_devices(["cuda:0"])


def test_cuda_index_beyond_the_machine_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, available=True, count=2)
    check_devices(["cuda:0", "cuda:1"])
    with pytest.raises(ConfigError, match=r"there is no cuda:2: this machine has 2 CUDA devices \(0\.\.1\)"):
        check_devices(["cuda:0", "cuda:2"])


def failing_set_device(device: object) -> None:
    raise RuntimeError("cannot set the device")


def test_worker_whose_device_cannot_be_set_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "set_device", failing_set_device)
    worker = DeviceWorker("cuda:0", load_model("tiny-llama"), EngineConfig(), TensorStore(), lambda report: None)
    worker.start()
    assert worker.ready.wait(10), "the worker died without telling the engine"
    assert isinstance(worker.error, RuntimeError) and not worker.alive
    worker.join(5)


async def test_engine_start_fails_when_a_worker_cannot_set_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, available=True, count=1)  # past the device check, into the worker
    monkeypatch.setattr(torch.cuda, "set_device", failing_set_device)
    engine = Engine(EngineConfig(devices=("cuda:0",)))
    with pytest.raises(MstarError, match="^worker on cuda:0 failed to start: RuntimeError: cannot set the device$"):
        await asyncio.wait_for(engine.start(), timeout=30)


@pytest.mark.parametrize("role", ["tts_walk", "spoken_chat_walk"])
async def test_a_model_naming_a_walk_it_lacks_does_not_start(role: str) -> None:
    model = load_model("tiny-llama")
    setattr(model, role, "whisper")
    with pytest.raises(ConfigError, match=f"model 'tiny-llama': its {role} 'whisper' is not one of its walks"):
        await Engine(EngineConfig(), model=model).start()


async def test_a_model_naming_a_spoken_audio_key_its_spoken_walk_lacks_does_not_start() -> None:
    model = load_model("qwen3-omni-tiny")
    model.spoken_audio_key = "talkr"
    with pytest.raises(ConfigError, match="its spoken_audio_key 'talkr' is not a sampling key of its spoken_chat_walk"):
        await Engine(EngineConfig(model="qwen3-omni-tiny"), model=model).start()


@pytest.mark.parametrize("host,url,demo", [
    ("127.0.0.1", "http://127.0.0.1:8000", "http://127.0.0.1:8000/"),
    ("0.0.0.0", "http://0.0.0.0:8000", "http://127.0.0.1:8000/"),
    ("::", "http://[::]:8000", "http://[::1]:8000/"),
    ("localhost", "http://localhost:8000", "http://localhost:8000/"),
])
def test_urls_a_client_can_open(host: str, url: str, demo: str) -> None:
    assert (listener.url(host, 8000), listener.demo_url(host, 8000)) == (url, demo)


def test_bind_holds_the_port() -> None:
    sock = listener.bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(OSError):
            listener.bind("127.0.0.1", port)
    finally:
        sock.close()


def _handshakes(port: int, n: int, within_s: float) -> int:
    """How many of `n` connections to `port` complete their handshake within
    `within_s`, while nothing accepts them."""
    socks = [socket.socket() for _ in range(n)]
    try:
        with selectors.DefaultSelector() as sel:   # not select(): descriptors past 1024
            for s in socks:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                sel.register(s, selectors.EVENT_WRITE)
            done, waiting = 0, n
            deadline = time.monotonic() + within_s
            while waiting and (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):   # writable: the handshake completed, or failed
                    sel.unregister(key.fileobj)
                    waiting -= 1
                    done += key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
            return done
    finally:
        for s in socks:
            s.close()


CLIENTS = 300


@pytest.mark.skipif((listener.backlog_cap() or 0) < CLIENTS,
                    reason="the kernel caps a listen backlog below the burst (Linux's net.core.somaxconn)")
async def test_a_burst_of_clients_waits_in_the_backlog_not_in_a_retry() -> None:
    """aiohttp's site listens again on the bound socket; with its default
    backlog of 128 the 129th waiting connection's handshake is dropped and
    retried a second later. A burst must all be held while the event loop
    is busy (here: blocked by this test)."""
    sock = listener.bind("127.0.0.1", 0)
    runner = web.AppRunner(web.Application())
    try:
        await runner.setup()
        await listener.site(runner, sock).start()
        assert _handshakes(sock.getsockname()[1], CLIENTS, within_s=0.5) == CLIENTS
    finally:
        await runner.cleanup()
        sock.close()
