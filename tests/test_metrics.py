"""`GET /metrics` against the real tiny-llama engine: request counts by
status, first-token latency, steps by mode, KV pages, and a text that parses
as the Prometheus exposition format; plus the renderer on its own."""

from __future__ import annotations

import asyncio
import gc
import math
import re
import time

import aiohttp
import pytest
from http_support import MODEL, running_engine, wait_until

from mstar.engine.engine import Engine
from mstar.engine.eventloop.metrics import LAG_BUCKETS, EngineMetrics, GCPauses
from mstar.engine.eventloop.prometheus import Histogram, family
from mstar.types import GenerateRequest, SamplingParams

Sample = tuple[str, dict[str, str], float]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse(text: str) -> list[Sample]:
    """Every sample of an exposition text; asserts that each line is well
    formed and that every sampled family has its HELP and TYPE first."""
    helped: set[str] = set()
    typed: dict[str, str] = {}
    samples: list[Sample] = []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split(" ", 3)[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            typed[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, _, body, value = m.groups()
        labels: dict[str, str] = {}
        if body:
            pos = 0
            while pos < len(body):
                lm = _LABEL.match(body, pos)
                assert lm, f"bad labels in {line!r}"
                labels[lm.group(1)] = lm.group(2)
                pos = lm.end()
        base = re.sub(r"_(bucket|sum|count)$", "", name) if typed.get(name) is None else name
        assert base in typed and base in helped, f"{name} has no HELP/TYPE before it"
        samples.append((name, labels, float(value)))
    return samples


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def leftovers(metrics: EngineMetrics) -> dict[str, dict]:
    """The per-request dicts of `metrics` that still hold something."""
    return {k: v for k, v in vars(metrics).items() if k.startswith("_") and isinstance(v, dict) and v}


def phases(samples: list[Sample], suffix: str) -> tuple[float, float, float]:
    """The queue, prefill and decode histograms' `_sum` or `_count`."""
    return tuple(value(samples, f"mstar_request_{p}_time_seconds_{suffix}")  # type: ignore[return-value]
                 for p in ("queue", "prefill", "decode"))


def test_renderer() -> None:
    h = Histogram((0.1, 1.0), labelled=True)
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v, (("mode", "decode"),))
    text = family("x_seconds", "histogram", "A test.", h) + family(
        "y_total", "counter", "Another.", [((("status", 'a"b\\c\n'),), 3), ((), 1.5)])
    assert text.splitlines() == [
        "# HELP x_seconds A test.",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{mode="decode",le="0.1"} 2',   # `le` is inclusive
        'x_seconds_bucket{mode="decode",le="1"} 3',
        'x_seconds_bucket{mode="decode",le="+Inf"} 4',
        'x_seconds_sum{mode="decode"} 2.65',
        'x_seconds_count{mode="decode"} 4',
        "# HELP y_total Another.",
        "# TYPE y_total counter",
        'y_total{status="a\\"b\\\\c\\n"} 3',
        "y_total 1.5",
    ]
    samples = parse(text)
    assert value(samples, "y_total", status='a\\"b\\\\c\\n') == 3
    assert h.count((("mode", "decode"),)) == 4 and h.count() == 0
    assert math.isclose(value(samples, "x_seconds_sum"), 2.65)
    # an unlabelled histogram shows its zero series before any observation
    assert parse(family("z_seconds", "histogram", "Empty.", Histogram((1.0,))))[-1] == ("z_seconds_count", {}, 0.0)


@pytest.mark.asyncio(loop_scope="module")
async def test_metrics_after_some_requests(engine: Engine, http: aiohttp.ClientSession) -> None:
    # long enough for full KV pages: the second request finds them in the prefix cache
    body = {"model": MODEL, "prompt": "Once upon a time there was a tiny model. " * 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        async with http.post("/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["finish_reason"] == "length"
    # one aborted after its first token
    sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = engine.submit(GenerateRequest("metrics-abort", MODEL, {"prompt_ids": [5, 6, 7]}, sp))
    async for chunk in stream:
        if chunk.token_ids:
            engine.abort(stream.request_id)
            break
    await stream.aclose()
    assert await wait_until(lambda: engine.num_running() == 0 and engine.pages_in_use() == 0)

    async with http.get("/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        samples = parse(await r.text())

    counts = {s: value(samples, "mstar_requests_total", status=s) for s in ("stop", "length", "abort", "error")}
    assert counts == {"stop": 0, "length": 2, "abort": 1, "error": 0}
    prompt = len(engine.tokenizer(MODEL).encode(body["prompt"]))
    assert value(samples, "mstar_prompt_tokens_total") == 2 * prompt + 3
    assert value(samples, "mstar_generation_tokens_total") >= 2 * 4 + 1  # the aborted one drew one or more
    assert value(samples, "mstar_requests_refused_total") == 0
    # the two answers that ran to their end, timed whole and per token after the first
    assert value(samples, "mstar_e2e_request_latency_seconds_count") == 2
    assert value(samples, "mstar_time_per_output_token_seconds_count") == 2
    assert 0 < value(samples, "mstar_time_per_output_token_seconds_sum") < \
        value(samples, "mstar_e2e_request_latency_seconds_sum")
    # every request produced tokens before it ended, the aborted one included
    assert value(samples, "mstar_time_to_first_token_seconds_count") == 3
    assert value(samples, "mstar_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value(samples, "mstar_time_to_first_audio_seconds_count") == 0
    # that time split, as vLLM's, for the same two answers as the end-to-end time (the aborted one is in
    # none of them): waiting, computing to the first token, and the rest, which add up to it
    assert phases(samples, "count") == (2, 2, 2)
    queue, prefill, decode = phases(samples, "sum")
    assert queue > 0 and prefill > 0 and decode > 0
    assert queue + prefill <= value(samples, "mstar_time_to_first_token_seconds_sum") + 1e-9
    assert math.isclose(queue + prefill + decode, value(samples, "mstar_e2e_request_latency_seconds_sum"),
                        rel_tol=1e-9, abs_tol=1e-9)
    assert leftovers(engine._metrics) == {}
    assert value(samples, "mstar_kv_pages_in_use", component="llm") == 0
    assert value(samples, "mstar_kv_pages_total", component="llm") > 0
    assert value(samples, "mstar_kv_rows_running", component="llm") == 0
    assert value(samples, "mstar_preemptions_total") == 0
    assert value(samples, "mstar_requests_running") == 0
    assert value(samples, "mstar_queue_depth") == 0
    for mode in ("prefill", "decode"):
        assert value(samples, "mstar_step_seconds_count", component="llm", mode=mode) > 0
        assert value(samples, "mstar_batch_size_count", component="llm", mode=mode) > 0
    assert value(samples, "mstar_decode_steps_total") == value(
        samples, "mstar_step_seconds_count", component="llm", mode="decode")
    assert value(samples, "mstar_speculative_steps_dropped_total") >= 0
    assert value(samples, "mstar_tensors_held") >= 0
    queries = value(samples, "mstar_prefix_cache_queries_total", component="llm")
    hits = value(samples, "mstar_prefix_cache_hits_total", component="llm")
    assert queries > hits >= 64 and hits % 16 == 0  # the second prompt's full pages, all but its last token's
    assert value(samples, "mstar_prefix_cache_pages", component="llm") >= 4
    # the worker's CPU time in decode steps: positive, and within the wall time of the phases it ran
    wall = sum(value(samples, "mstar_worker_seconds_total", phase=ph) for ph in ("launch", "finalize", "wait"))
    cpu = sum(value(samples, "mstar_worker_cpu_seconds_total", phase=ph) for ph in ("launch", "finalize"))
    assert 0 < cpu <= wall * 1.05 + 1e-3
    # the engine times Python's collections: every generation has its series, from the start
    assert {ls["generation"] for n, ls, _ in samples if n == "mstar_gc_pause_seconds_count"} == {"0", "1", "2"}
    full = value(samples, "mstar_gc_pause_seconds_count", generation="2")
    gc.collect()
    async with http.get("/metrics") as r:
        assert value(parse(await r.text()), "mstar_gc_pause_seconds_count", generation="2") >= full + 1


def test_gc_pauses_are_timed_by_generation_while_started() -> None:
    hist = Histogram(LAG_BUCKETS, labelled=True)
    pauses = GCPauses(hist)
    full = (("generation", "2"),)
    pauses.start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.stop()
    assert hist.count(full) == 1 and hist.series[full][-1] > 0
    assert hist.count((("generation", "0"),)) >= 1
    gc.collect()
    assert hist.count(full) == 1  # stopped: no longer timed
    pauses.stop()  # a second stop is harmless
    pauses._on_gc("stop", {"generation": 2})  # a collection under way when the hook went in: not timed
    assert hist.count(full) == 1 and hist.series[full][-1] < 60


async def test_the_queue_depth_counts_requests_waiting_to_start_not_running_ones() -> None:
    """One row at a time (`max_num_seqs` 1): while one request runs, the two
    after it wait to start, and the gauge says 2, not 3 (vLLM's
    num_requests_waiting)."""
    from mstar.config import EngineConfig, SchedulerConfig

    one_row = EngineConfig(model=MODEL, scheduler=SchedulerConfig(max_num_seqs=1))
    async with running_engine(config=one_row) as eng:
        long = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)
        streams = [eng.submit(GenerateRequest(f"q{i}", MODEL, {"prompt_ids": [1, 2, 3]}, long)) for i in range(3)]
        first = aiter(streams[0])
        await anext(first)  # the first runs
        # the other two reach the worker's scheduler through its inbox, maybe after the first's chunk
        depth = lambda: value(parse(eng.metrics_text()), "mstar_queue_depth")  # noqa: E731
        assert await wait_until(lambda: depth() == 2, timeout=30), depth()
        assert eng.num_running() == 3  # none of them finished: the first is long, so 2 still wait
        for s in streams:
            eng.abort(s.request_id)
        assert await wait_until(lambda: eng.num_running() == 0, timeout=30)
        samples = parse(eng.metrics_text())
        assert value(samples, "mstar_queue_depth") == 0
        # aborted answers are timed in no phase (the two that never started, nor the one that ran), and leave
        # nothing behind
        assert phases(samples, "count") == (0, 0, 0)
        assert leftovers(eng._metrics) == {}


async def test_a_request_queued_behind_a_full_batch_waits_longer_for_its_first_step() -> None:
    """One row at a time: the second request's first step waits for the
    first request's whole answer, and its queue time says so."""
    from mstar.config import EngineConfig, SchedulerConfig

    one_row = EngineConfig(model=MODEL, scheduler=SchedulerConfig(max_num_seqs=1))
    async with running_engine(config=one_row) as eng:
        sp = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
        streams = [eng.submit(GenerateRequest(f"b{i}", MODEL, {"prompt_ids": [1, 2, 3]}, sp)) for i in range(2)]
        async for _ in streams[0]:
            pass
        # the first answer is timed as it ends, while the second waits for its first step still (one row)
        assert await wait_until(lambda: phases(parse(eng.metrics_text()), "count") == (1, 1, 1), timeout=30)
        q1 = value(parse(eng.metrics_text()), "mstar_request_queue_time_seconds_sum")
        async for _ in streams[1]:
            pass
        assert await wait_until(lambda: eng.num_running() == 0, timeout=30)
        samples = parse(eng.metrics_text())
        assert phases(samples, "count") == (2, 2, 2)
        q2 = value(samples, "mstar_request_queue_time_seconds_sum") - q1
        # it waited out the first's 40 tokens: longer than the first waited, and than the first computed its first
        assert q2 > q1 and q2 > value(samples, "mstar_request_prefill_time_seconds_sum") / 2
        assert leftovers(eng._metrics) == {}


async def test_a_prompt_that_rides_in_decode_steps_starts_at_its_first_chunk() -> None:
    """A request arriving while another decodes: its prompt rides in the
    running group's steps (mixed), in two chunks of the step's token budget;
    the step of its first chunk, and only that one, reports its start."""
    from mstar.config import EngineConfig, SchedulerConfig

    budget = EngineConfig(model=MODEL, scheduler=SchedulerConfig(max_num_batched_tokens=80))
    async with running_engine(config=budget) as eng:
        starts: list[tuple[str, str, float]] = []  # (request, mode of the step, its start)
        eng.add_report_hook(lambda r: starts.extend((rid, r.mode, at) for rid, at in r.started))
        long = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        running = aiter(eng.submit(GenerateRequest("running", MODEL, {"prompt_ids": [1, 2, 3]}, long)))
        await anext(running)
        await anext(running)  # decoding now
        sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        late = [c async for c in eng.submit(GenerateRequest("late", MODEL, {"prompt_ids": list(range(5, 155))}, sp))]
        assert late[-1].finish_reason == "length"
        eng.abort("running")
        assert await wait_until(lambda: eng.num_running() == 0, timeout=30)
        samples = parse(eng.metrics_text())
        assert value(samples, "mstar_mixed_rows_total") >= 2  # its 150 tokens: 79 beside the running row, 71
        assert [(rid, mode) for rid, mode, _ in starts] == [("running", "prefill"), ("late", "decode")]
        assert t < starts[1][2] < time.perf_counter()
        assert phases(samples, "count") == (1, 1, 1)  # the aborted "running" is timed in none
        assert leftovers(eng._metrics) == {}


async def test_a_spoken_answer_splits_its_time_to_first_audio() -> None:
    """Orpheus `speak`: no token reaches the event loop; its first audio
    code (`StepReport.sampled`) ends its prefill, many codes before its
    first audio."""
    async with running_engine("orpheus-tiny") as eng:
        sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        chunks = [c async for c in eng.submit(GenerateRequest("spoken", "orpheus-tiny", {"text": "hi"}, sp))]
        assert chunks[-1].finish_reason == "length" and any(c.audio is not None for c in chunks)
        assert await wait_until(lambda: eng.num_running() == 0, timeout=30)
        samples = parse(eng.metrics_text())
        assert value(samples, "mstar_time_to_first_token_seconds_count") == 0
        assert value(samples, "mstar_time_to_first_audio_seconds_count") == 1
        assert phases(samples, "count") == (1, 1, 1)
        queue, prefill, decode = phases(samples, "sum")
        assert queue > 0 and prefill > 0 and decode > 0
        # its first code came with its prompt step; its first audio waited for a window of codes after it, 27 of
        # the 49 decode steps
        assert value(samples, "mstar_time_to_first_audio_seconds_sum") - (queue + prefill) > decode / 5
        # one answer, timed whole: the three phases are its end-to-end time
        assert math.isclose(queue + prefill + decode, value(samples, "mstar_e2e_request_latency_seconds_sum"),
                            rel_tol=1e-9, abs_tol=1e-9)
        assert leftovers(eng._metrics) == {}


def test_a_cancelled_request_leaves_nothing_behind() -> None:
    """A request cancelled at any point (before its first step, before its
    first token, after it) leaves every per-request dict at once, and what
    its workers still report of it after that (the steps they had under
    way, its end) puts nothing back; only answers that ran to their end are
    timed, in every phase."""
    m = EngineMetrics()
    for stage in range(4):
        rid = f"r{stage}"
        m.submitted(rid)
        if stage >= 1:
            m.started([(rid, time.perf_counter())])
        if stage >= 2:
            m.drawn([rid])
        if stage >= 3:
            m.outputs([rid], "text")
        m.forget(rid)
        assert leftovers(m) == {}, stage
        m.started([(rid, time.perf_counter())])
        m.drawn([rid])
        m.outputs([rid], "text")
        m.outputs([rid], "audio")
        m.finished(rid, "abort", 3, 2, 2)
        assert leftovers(m) == {}, stage
    assert (m.queue_time.count(), m.prefill_time.count(), m.decode_time.count(), m.ttft.count()) == (0, 0, 0, 1)
    # one that ran to its end, its first step reported twice (a later component's first): timed once
    m.submitted("done")
    at = time.perf_counter()
    m.started([("done", at)])
    m.started([("done", at + 1.0)])
    m.outputs(["done"], "text")
    m.finished("done", "stop", 3, 2, 2)
    assert (m.queue_time.count(), m.prefill_time.count(), m.decode_time.count()) == (1, 1, 1)
    assert 0 < m.prefill_time.series[()][-1] < 1.0  # timed from the first start: from the second, it would be < 0
    assert leftovers(m) == {}


async def test_a_request_that_starts_with_its_media_is_timed_from_the_encoder_step() -> None:
    """Qwen3-Omni `chat` with an audio part: the request's first step is the
    audio encoder's, not a KV prompt chunk; its queue time ends there, and
    its prefill (the encoder and the thinker's prompt) runs to its first
    text token."""
    import numpy as np

    t = np.arange(16000) / 16000  # a second of a tone, as the HTTP layer decodes an input_audio part (16 kHz mono)
    heard = {"type": "audio", "audio": (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)}
    async with running_engine("qwen3-omni-tiny", 512) as eng:
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, heard]}]
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        request = GenerateRequest("heard", "qwen3-omni-tiny", {"messages": messages}, sp, walk="chat")
        chunks = [c async for c in eng.submit(request, await eng.prepare(request))]
        assert chunks[-1].finish_reason == "length"
        assert await wait_until(lambda: eng.num_running() == 0, timeout=30)
        samples = parse(eng.metrics_text())
        assert value(samples, "mstar_time_to_first_token_seconds_count") == 1
        assert phases(samples, "count") == (1, 1, 1)
        queue, prefill, _ = phases(samples, "sum")
        assert queue > 0 and prefill > 0
        assert queue + prefill <= value(samples, "mstar_time_to_first_token_seconds_sum")
        assert leftovers(eng._metrics) == {}


async def test_a_batch_run_as_two_calls_starts_each_request_at_its_own_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Omni: a `chat` prompt and a `speak` prompt in one prompt step
    write different values, so the step runs as two calls
    (`ComponentRunner.by_writes`); each request's start is its own call's,
    not the first call's (the second call waits for the first to end)."""
    from mstar.engine.execution.runner import ComponentRunner

    calls: list[tuple[list[str], float, float]] = []  # each prompt call's requests, its start and end
    compute = ComponentRunner.compute

    def slow(self: ComponentRunner, batch, inputs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        if batch.mode == "prefill" and batch.component == "thinker":
            time.sleep(0.1)  # a prompt step long enough to tell the calls' starts apart
        try:
            return compute(self, batch, inputs)
        finally:
            if batch.mode == "prefill" and batch.component == "thinker":
                calls.append(([i.request_id for i in batch.items], t0, time.perf_counter()))

    monkeypatch.setattr(ComponentRunner, "compute", slow)
    async with running_engine("qwen3-omni-tiny", 512) as eng:
        starts: dict[str, float] = {}
        eng.add_report_hook(lambda r: starts.update(r.started))
        hello = {"messages": [{"role": "user", "content": "hello"}]}
        sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
        chat = GenerateRequest("chat", "qwen3-omni-tiny", hello, sp, walk="chat")
        speak = GenerateRequest("speak", "qwen3-omni-tiny", {**hello, "voice": "ethan"}, sp, walk="speak",
                                sampling_by={"talker": {"max_tokens": 3, "ignore_eos": True}})

        async def run(req: GenerateRequest) -> None:
            async for _ in eng.submit(req, await eng.prepare(req)):
                pass
        await asyncio.gather(run(chat), run(speak))
        (one, t1, end1), (two, t2, _) = calls[:2]  # submitted together, they share a prompt step
        assert t2 >= end1  # the second call began after the first ended
        assert starts[one[0]] <= t1 and starts[two[0]] >= end1 - 1e-3
