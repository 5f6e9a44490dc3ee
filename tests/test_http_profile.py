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
from aiohttp import web
from http_support import serving_app, wait_until
from profile_support import DEADLINE_S, ProfileGate, profiler_free

from mstar.config import EngineConfig, ServerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.http.ops import profile as profile_routes
from mstar.http.server import build_app

pytestmark = pytest.mark.asyncio(loop_scope="module")


def serve(engine: Engine, **config: object):
    return serving_app(build_app(engine, manage_engine=False, config=ServerConfig(**config)),
                       handler_cancellation=True, access_log=None, shutdown_timeout=1.0)


async def test_a_profile_while_serving_names_the_decode_steps(engine: Engine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # however slowly the worker runs, each profile lasts until a step of the completion ran inside it
    ProfileGate(engine, monkeypatch, held=False, steps=1)
    decoding = asyncio.Event()

    def on_report(r: StepReport) -> None:
        if r.mode == "decode" and r.rows:
            decoding.set()

    engine.add_report_hook(on_report)
    async with serve(engine, profiling=True) as url, aiohttp.ClientSession() as http:
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True}

        async def complete() -> None:
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()

        running = asyncio.create_task(complete())
        try:
            assert await wait_until(lambda: decoding.is_set() or running.done(), DEADLINE_S), \
                f"waited {DEADLINE_S:g} s for the completion to decode"
        finally:
            engine.remove_report_hook(on_report)
        if running.done():
            running.result()  # its error, if it failed
            pytest.fail("the completion ended before it decoded")
        # it is past its prefill: every step from here on is a decode step
        deadline = aiohttp.ClientTimeout(total=DEADLINE_S)
        async with http.post(url + "/debug/profile", json={"seconds": 0.05, "rows": 10}, timeout=deadline) as r:
            assert r.status == 200 and r.content_type == "text/plain"
            text = await r.text()
        # every row (the most the route gives): whether the mstar rows make a shorter table's top depends on
        # what else ran in the process meanwhile (the event loop's polls, the report threads)
        async with http.post(url + "/debug/profile", json={"seconds": 0.05, "rows": 500, "stacks": True},
                             timeout=deadline) as r:
            assert r.status == 200
            stacked = await r.text()
        # the gate held each profile open until a step ran inside it: the completion's, the only work there is
        running.cancel()  # the client hangs up; the server aborts the request
    assert "worker 0 (cpu)" in text
    assert "mstar.llm.decode" in text and "ops by their own CPU time" in text
    assert "aten::" in text  # torch's ops inside the steps
    assert "Python stack" not in text
    # with stacks, ops are told apart by the mstar code that called them
    assert "ops by their own CPU time and Python stack" in stacked and "mstar/engine/" in stacked
    assert "Source Location" in stacked  # the ops' stacks were recorded (torch leaves the column out without them)


async def test_a_second_profile_of_a_worker_waits_its_turn(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = ProfileGate(engine, monkeypatch)  # the first profile runs until the second is answered
    async with serve(engine, profiling=True) as url, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
        async def profile() -> int:
            async with http.post(url + "/debug/profile", json={"seconds": 0.3}) as r:
                return r.status
        first = asyncio.create_task(profile())
        await gate.running(0)
        assert await profile() == 409
        gate.release()
        assert await first == 200


async def test_a_client_that_hangs_up_mid_profile_leaves_the_worker_serving(engine: Engine,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    gate = ProfileGate(engine, monkeypatch)  # the profile outlives its client
    hung_up = asyncio.Event()
    route = profile_routes.profile

    async def watched(request: web.Request) -> web.StreamResponse:
        try:
            return await route(request)
        except asyncio.CancelledError:  # the server saw the client go
            hung_up.set()
            raise

    monkeypatch.setattr(profile_routes, "profile", watched)  # build_app (in serve) routes to it
    async with serve(engine, profiling=True) as url:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
            async def abandoned() -> None:
                async with http.post(url + "/debug/profile", json={"seconds": 0.6}) as r:
                    await r.read()

            hanging_up = asyncio.create_task(abandoned())
            await gate.running(0)  # mid-profile
            hanging_up.cancel()
            with pytest.raises(asyncio.CancelledError):
                await hanging_up
        assert await wait_until(hung_up.is_set, DEADLINE_S), \
            f"waited {DEADLINE_S:g} s for the server to cancel the profile's handler"
        assert engine.workers[0].profiler.running  # the hang-up came mid-profile
        gate.release()  # the worker ends the profile at its time, with nobody waiting for it
        assert await wait_until(profiler_free, DEADLINE_S), \
            f"waited {DEADLINE_S:g} s for the abandoned profile to end and free the profiler"
        assert engine.workers[0].alive
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
            async with http.post(url + "/debug/profile", json={"seconds": 0.2}) as r:
                assert r.status == 200
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 3}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200


async def test_two_workers_profile_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's profiler is one per process: a second worker's profile while
    the first runs is a 409, not a second profiler."""
    eng = Engine(EngineConfig(model="tiny-llama", devices=("cpu:0", "cpu:1")))
    await eng.start()
    try:
        gate = ProfileGate(eng, monkeypatch)  # worker 0's profile runs until worker 1's is answered
        async with serve(eng, profiling=True) as url, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
            async def profile(worker: int) -> int:
                async with http.post(url + "/debug/profile", json={"seconds": 0.4, "worker": worker}) as r:
                    return r.status
            first = asyncio.create_task(profile(0))
            await gate.running(0)
            assert await profile(1) == 409
            gate.release()
            assert await first == 200
            assert all(w.alive for w in eng.workers)
    finally:
        await eng.shutdown()


@pytest.mark.parametrize("body", [{"seconds": 0}, {"seconds": 61}, {"seconds": "2"}, {"worker": 1},
                                  {"worker": 0.5}, {"rows": 0}, {"stacks": 1}, [1]])
async def test_bad_fields_are_400s(engine: Engine, body: object) -> None:
    async with serve(engine, profiling=True) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/debug/profile", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["type"] == error["code"] == "invalid_request_error"
            if isinstance(body, dict):  # named as every route names a field: param, and the message's lead
                field = next(iter(body))
                assert error["param"] == field and error["message"].startswith(f"{field}: "), error


async def test_without_the_flag_there_is_no_route(engine: Engine) -> None:
    async with serve(engine) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/debug/profile", json={}) as r:
            assert r.status == 404


async def test_the_flag_parses() -> None:
    assert parse_args(["--enable-profiling"]).profiling
    assert not parse_args([]).profiling
