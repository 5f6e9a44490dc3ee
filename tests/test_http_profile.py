"""`POST /debug/profile` with `--enable-profiling` on a real tiny-llama server:
a profile taken while a completion streams names the worker's decode steps
and their ops; one profile runs in the process at a time (409 for another,
on any worker); a client that hangs up mid-profile leaves the worker
serving; bad fields are 400s; without the flag the route is not there; the
flag parses."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from http_support import serving_app

from mstar.config import EngineConfig, ServerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.http.server import build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")


def serve(engine: Engine, **config: object):
    return serving_app(build_app(engine, manage_engine=False, config=ServerConfig(**config)),
                       handler_cancellation=True, access_log=None, shutdown_timeout=1.0)


async def test_a_profile_while_serving_names_the_decode_steps(engine: Engine) -> None:
    async with serve(engine, profiling=True) as url, aiohttp.ClientSession() as http:
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True}

        async def complete() -> None:
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()

        running = asyncio.create_task(complete())
        await asyncio.sleep(0.3)  # decoding by now
        async with http.post(url + "/debug/profile", json={"seconds": 0.05, "rows": 10}) as r:
            assert r.status == 200 and r.content_type == "text/plain"
            text = await r.text()
        async with http.post(url + "/debug/profile", json={"seconds": 0.05, "rows": 10, "stacks": True}) as r:
            assert r.status == 200
            stacked = await r.text()
        assert not running.done(), "the completion should still be decoding"
        running.cancel()  # the client hangs up; the server aborts the request
    assert "worker 0 (cpu)" in text
    assert "mstar.llm.decode" in text and "ops by their own CPU time" in text
    assert "aten::" in text  # torch's ops inside the steps
    assert "Python stack" not in text
    # with stacks, ops are told apart by the mstar code that called them
    assert "ops by their own CPU time and Python stack" in stacked and "mstar/engine/" in stacked


async def test_a_second_profile_of_a_worker_waits_its_turn(engine: Engine) -> None:
    async with serve(engine, profiling=True) as url, aiohttp.ClientSession() as http:
        async def profile() -> int:
            async with http.post(url + "/debug/profile", json={"seconds": 0.3}) as r:
                return r.status
        assert sorted(await asyncio.gather(profile(), profile())) == [200, 409]


async def test_a_client_that_hangs_up_mid_profile_leaves_the_worker_serving(engine: Engine) -> None:
    async with serve(engine, profiling=True) as url:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as http:
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(url + "/debug/profile", json={"seconds": 0.6}) as r:
                    await r.read()
        await asyncio.sleep(0.8)  # the abandoned profile's time is up
        assert engine.workers[0].alive
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/debug/profile", json={"seconds": 0.2}) as r:
                assert r.status == 200
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 3}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200


async def test_two_workers_profile_one_at_a_time() -> None:
    """torch's profiler is one per process: a second worker's profile while
    the first runs is a 409, not a second profiler."""
    eng = Engine(EngineConfig(model="tiny-llama", devices=("cpu:0", "cpu:1")))
    await eng.start()
    try:
        async with serve(eng, profiling=True) as url, aiohttp.ClientSession() as http:
            async def profile(worker: int) -> int:
                async with http.post(url + "/debug/profile", json={"seconds": 0.4, "worker": worker}) as r:
                    return r.status
            assert sorted(await asyncio.gather(profile(0), profile(1))) == [200, 409]
            assert all(w.alive for w in eng.workers)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("body", [{"seconds": 0}, {"seconds": 61}, {"seconds": "2"}, {"worker": 1},
                                  {"worker": 0.5}, {"rows": 0}, {"stacks": 1}, [1]])
async def test_bad_fields_are_400s(engine: Engine, body: object) -> None:
    async with serve(engine, profiling=True) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/debug/profile", json=body) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_without_the_flag_there_is_no_route(engine: Engine) -> None:
    async with serve(engine) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/debug/profile", json={}) as r:
            assert r.status == 404


async def test_the_flag_parses() -> None:
    assert parse_args(["--enable-profiling"]).profiling
    assert not parse_args([]).profiling
