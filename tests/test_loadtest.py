"""scripts/loadtest.py's judges: what counts as a proper stream, a proper
4xx and a settled /metrics, without a server."""

from __future__ import annotations

import json
import random
import sys
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

import aiohttp
from aiohttp import web
from http_support import serving_app
from loadtest import (POISONED, SPEECH_ROUTE, Job, Tally, check_error, check_stream, make_jobs, percentile,
                      poison_bursts, report, run_job)
from loadtest_cases import BigPrompt
from prometheus_samples import samples


def _sse(n: int, finish: str = "length") -> list:
    pieces = [{"choices": [{"text": "x", "finish_reason": None}], "usage": None} for _ in range(n - 1)]
    pieces.append({"choices": [{"text": "x", "finish_reason": finish}], "usage": None})
    return [*pieces, {"choices": [], "usage": {"completion_tokens": n}}, "[DONE]"]


def test_sse_stream_needs_length_usage_and_done() -> None:
    assert check_stream("/v1/completions", _sse(3), 3) == ""
    assert "tokens" in check_stream("/v1/completions", _sse(3), 4)
    assert "finish_reason" in check_stream("/v1/completions", _sse(3, "stop"), 3)
    assert "[DONE]" in check_stream("/v1/chat/completions", _sse(3)[:-1], 3)
    assert "error" in check_stream("/v1/completions", [{"error": {"message": "boom"}}, "[DONE]"], 1)


def test_ndjson_stream_counts_token_ids() -> None:
    lines = [{"token_ids": [1], "finished": False}, {"token_ids": [2], "finished": False},
             {"token_ids": [], "finished": True, "finish_reason": "length", "usage": {"completion_tokens": 2}}]
    assert check_stream("/generate", lines, 2) == ""
    assert "tokens" in check_stream("/generate", lines, 3)
    assert "finished" in check_stream("/generate", lines[:-1], 2)


def test_speech_stream_needs_whole_samples_and_one_done() -> None:
    import base64

    def delta(n: int) -> dict:
        return {"type": "speech.audio.delta", "audio": base64.b64encode(b"\0" * n).decode()}

    done = {"type": "speech.audio.done", "usage": {"input_tokens": 5, "output_tokens": 21, "total_tokens": 26}}
    assert check_stream(SPEECH_ROUTE, [delta(4096), delta(4096), done], 21) == ""
    assert "whole samples" in check_stream(SPEECH_ROUTE, [delta(3), done], 21)
    assert "usage" in check_stream(SPEECH_ROUTE, [delta(4), done], 20)
    assert "exactly one" in check_stream(SPEECH_ROUTE, [delta(4)], 21)
    assert "error" in check_stream(SPEECH_ROUTE, [{"type": "error", "error": {"message": "x"}}], 21)


def test_speech_jobs_are_spread_over_the_streams() -> None:
    a = Namespace(requests=30, disconnects=6, malformed=0, speech=10)
    jobs = make_jobs(a, "orpheus-tiny", random.Random(0))
    speech = [j for j in jobs if j.route == SPEECH_ROUTE]
    assert len(speech) == 10 and any(j.kind == "disconnect" for j in speech)
    assert all(json.loads(j.body)["stream_format"] == "sse" for j in speech)


def test_a_speech_only_server_gets_speech_streams_beside_the_text_routes_refusals() -> None:
    """Under --audio-logits-only the text routes refuse every request: the
    streams and the poisoned requests' good neighbours go to speech, the
    malformed and poisoned requests keep their text routes (they are
    validated before the refusal)."""
    a = Namespace(requests=30, disconnects=6, malformed=5, speech=0)
    jobs = make_jobs(a, "orpheus-tiny", random.Random(0), speech_only=True)
    assert {j.route for j in jobs if j.kind != "malformed"} == {SPEECH_ROUTE}
    assert {j.route for j in jobs if j.kind == "malformed"} - {SPEECH_ROUTE}
    # a speech stream sends an event a 7-token frame: its cuts fall among those
    assert all(j.cut_after <= max(1, j.max_tokens // 7 - 2) for j in jobs if j.kind == "disconnect")
    bursts = poison_bursts("orpheus-tiny", 3, random.Random(0), speech_only=True)
    assert [b[0].route for b in bursts] == [case[0] for case in POISONED]
    assert all(j.route == SPEECH_ROUTE and j.kind == "stream" for b in bursts for j in b[1:])


def test_a_big_speech_input_must_be_refused_naming_input() -> None:
    seen = BigPrompt(8, expect="input", status=400, param="input", health_s=[0.01])
    assert seen.problems() == []
    seen.param = "prompt"
    assert "naming 'input'" in seen.problems()[0]


def test_error_must_be_4xx_naming_the_field() -> None:
    body = json.dumps({"error": {"message": "max_tokens: bad", "param": "max_tokens"}})
    assert check_error(400, body, "max_tokens") == ""
    assert "not 'prompt'" in check_error(400, body, "prompt")
    assert "not 4xx" in check_error(500, body, "max_tokens")
    assert "JSON" in check_error(400, "oops", "max_tokens")


def test_the_report_reads_metrics_summed_over_labels_and_by_status() -> None:
    # a cluster front labels each replica's series; an error finished on either counts
    before = samples('mstar_requests_total{replica="0",status="error"} 1\n')
    after = samples('mstar_kv_pages_in_use{replica="0",device="cpu"} 0\nmstar_tensors_held 0\n'
                    'mstar_requests_running 0\nmstar_requests_total{replica="0",status="error"} 1\n'
                    'mstar_requests_total{replica="1",status="error"} 2\n')
    assert report(Tally(), before, after, own_server=False) == ["2 requests finished as error"]
    # a gauge the server did not report fails its check rather than passing as 0
    assert "kv_pages_in_use -1" in report(Tally(), before, samples("mstar_tensors_held 0\n"), own_server=False)


def test_jobs_mix_and_percentile() -> None:
    a = Namespace(requests=30, disconnects=6, malformed=20)
    jobs = make_jobs(a, "tiny-llama", random.Random(0))
    kinds = [j.kind for j in jobs]
    assert (kinds.count("stream"), kinds.count("disconnect"), kinds.count("malformed")) == (24, 6, 20)
    assert all(1 <= j.max_tokens <= 32 and 0 <= j.cut_after <= j.max_tokens for j in jobs if j.kind == "disconnect")
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def _refusing_app(headers: dict[str, str], calls: list[int]) -> web.Application:
    """A server that answers 429 (with `headers`) once, then a proper 400."""
    async def handle(request: web.Request) -> web.Response:
        calls.append(1)
        if len(calls) == 1:
            return web.json_response({"error": {"message": "busy"}}, status=429, headers=headers)
        return web.json_response({"error": {"message": "bad", "param": "prompt"}}, status=400)

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


async def _send_once(headers: dict[str, str]):
    """A malformed job against the refusing server: its outcome and how many calls it took."""
    calls: list[int] = []
    job = Job("malformed", "/v1/completions", b"{}", expect_param="prompt")
    async with serving_app(_refusing_app(headers, calls)) as url, aiohttp.ClientSession() as session:
        return await run_job(session, url, job, time.monotonic() + 10), len(calls)


async def test_a_refused_job_waits_retry_after_and_tries_again() -> None:
    out, calls = await _send_once({"Retry-After": "0"})
    assert out.refusals == 1 and out.problem == "" and out.status == 400 and calls == 2


async def test_a_429_without_retry_after_is_a_problem() -> None:
    out, calls = await _send_once({})
    assert "Retry-After" in out.problem and calls == 1
