"""Per-request limits: a request that runs past --request-timeout ends with
"timeout" (504, or an error event on a stream) and frees what it held."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fake_model import FakeModel, Hold
from http_support import read_sse, serving
from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.types import GenerateRequest, SamplingParams


async def test_a_request_past_its_timeout_ends_and_frees_everything() -> None:
    hold = Hold()
    eng = Engine(EngineConfig(model="fake", request_timeout=0.2), model=FakeModel(gate=hold, max_steps=3))
    await eng.start()
    try:
        stream = eng.submit(GenerateRequest("slow", "fake", {"x": 0}, SamplingParams(), walk="count"))
        chunks = [c async for c in stream]  # the step is held: only the deadline can end it
        last = chunks[-1]
        assert last.finished and last.finish_reason == "timeout"
        assert "0.2 s" in last.error and "--request-timeout" in last.error
        hold.released.set()
        for _ in range(3000):  # the worker hears of it after the held step returns
            if len(eng.store) == 0 and eng.store.num_owners() == 0 and not eng.workers[0].walker.runs:
                break
            await asyncio.sleep(0.01)
        assert len(eng.store) == 0 and eng.store.num_owners() == 0 and not eng.workers[0].walker.runs
        assert 'mstar_requests_total{status="timeout"} 1' in eng.metrics_text()
    finally:
        hold.released.set()
        await eng.shutdown()


async def test_a_request_within_its_timeout_is_untouched() -> None:
    eng = Engine(EngineConfig(model="fake", request_timeout=30), model=FakeModel(max_steps=3))
    await eng.start()
    try:
        stream = eng.submit(GenerateRequest("quick", "fake", {"x": 0}, SamplingParams(), walk="count"))
        assert [c async for c in stream][-1].finish_reason == "length"
    finally:
        await eng.shutdown()


async def test_http_timeouts_are_504_or_an_error_event() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", request_timeout=0.05))
    await eng.start()
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
    try:
        async with serving(eng) as base, aiohttp.ClientSession(base_url=base) as http:
            async with http.post("/v1/completions", json=body) as r:
                assert r.status == 504
                error = (await r.json())["error"]
                assert error["code"] == "timeout" and "--request-timeout" in error["message"]
            async with http.post("/v1/completions", json={**body, "stream": True}) as r:
                assert r.status == 200
                events = await read_sse(r)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "timeout"
            assert 'status="timeout"' in eng.metrics_text()
    finally:
        await eng.shutdown()


def test_request_timeout_flag() -> None:
    from mstar.config import parse_args
    from mstar.errors import ConfigError

    assert parse_args([]).engine.request_timeout == 600.0
    assert parse_args(["--request-timeout", "0"]).engine.request_timeout == 0.0
    try:
        parse_args(["--request-timeout", "-1"])
    except ConfigError as e:
        assert "--request-timeout" in str(e)
    else:
        raise AssertionError("a negative timeout must be refused")


def test_a_waiting_line_that_holds_no_one_is_refused_at_startup() -> None:
    """`--max-waiting-requests 0` would answer every request 429, an idle server's too."""
    from mstar.config import parse_args
    from mstar.errors import ConfigError

    assert parse_args(["--max-waiting-requests", "1"]).engine.max_waiting_requests == 1
    with pytest.raises(ConfigError, match="--max-waiting-requests must be at least 1"):
        parse_args(["--max-waiting-requests", "0"])


@pytest.mark.parametrize(("flags", "says"), [
    (["--request-timeout", "nan"], "--request-timeout must be a finite number"),
    (["--queue-timeout", "inf"], "--queue-timeout must be a finite number"),
    (["--body-timeout", "nan"], "--body-timeout must be a finite number"),
    (["--num-pages", "0"], "--num-pages must be positive"),
    (["--num-pages", "-5"], "--num-pages must be positive"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory must be a positive number"),
    (["--kv-cache-memory", "nan"], "--kv-cache-memory must be a positive number"),
    (["--gpu-memory-utilization", "5"], r"--gpu-memory-utilization must be a share of the GPU's memory, in \(0, 1\]"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a share"),
    (["--max-num-batched-tokens", "4", "--max-num-seqs", "8"],
     r"--max-num-batched-tokens \(4\) must be at least --max-num-seqs \(8\)"),
    (["--gil-switch-interval-ms", "0"], "--gil-switch-interval-ms must be a positive number"),
    (["--gil-switch-interval-ms", "-1"], "--gil-switch-interval-ms must be a positive number"),
    (["--gil-switch-interval-ms", "nan"], "--gil-switch-interval-ms must be a positive number"),
    (["--host-arena-mb", "-5"], "--host-arena-mb must not be negative"),
])
def test_numeric_flags_past_their_bounds_are_refused_at_startup(flags: list[str], says: str) -> None:
    """Each used to start (0 pages quietly meant "from memory", a NaN timeout
    none, a decode step ignored a token budget below its rows, a NaN switch
    interval became 9e12 s), or to fail in the worker naming no flag (a negative
    arena), or with a traceback (a switch interval of 0 or less)."""
    from mstar.config import parse_args
    from mstar.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        parse_args(flags)


def test_numeric_flags_at_their_bounds_are_taken() -> None:
    from mstar.config import parse_args

    cfg = parse_args(["--num-pages", "1", "--gpu-memory-utilization", "1", "--max-num-batched-tokens", "8",
                      "--max-num-seqs", "8", "--kv-cache-memory", "0.01", "--request-timeout", "0",
                      "--host-arena-mb", "0", "--gil-switch-interval-ms", "0.5"])
    sched = cfg.engine.scheduler
    assert (sched.num_pages, sched.gpu_memory_utilization, sched.max_num_batched_tokens) == (1, 1.0, 8)
    assert cfg.engine.request_timeout == 0.0
    assert (cfg.engine.host_arena_mb, cfg.engine.gil_switch_interval_ms) == (0, 0.5)


def test_decode_graphs_reach_max_num_seqs_by_default() -> None:
    """Without `--cuda-graph-max-batch` the decode graphs cover every step
    `--max-num-seqs` allows, up to 512 rows; a step past the last bucket would
    run eagerly, its launches on the host."""
    from mstar.config import parse_args
    from mstar.errors import ConfigError

    def top(flags: list[str]) -> int:
        return parse_args(flags).engine.cuda_graph_batch_sizes[-1]

    assert top([]) == 256
    assert top(["--max-num-seqs", "512"]) == 512
    assert top(["--max-num-seqs", "64"]) == 64
    assert top(["--max-num-seqs", "400"]) == 400
    assert top(["--max-num-seqs", "2048", "--max-num-batched-tokens", "8192"]) == 512
    assert top(["--max-num-seqs", "512", "--cuda-graph-max-batch", "128"]) == 128
    assert top(["--max-num-seqs", "64", "--cuda-graph-max-batch", "256"]) == 256
    with pytest.raises(ConfigError, match="cuda-graph-max-batch"):
        parse_args(["--cuda-graph-max-batch", "0"])
