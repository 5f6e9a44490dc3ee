"""Bounded loopback load test: streaming, disconnecting and malformed requests
at once, then a check that the server lost nothing and leaked nothing.

Starts `python -m mstar.http --model tiny-llama --port P` itself (its output
in a log file) or targets a running server with `--url`, and waits for
/health. Then fires, all through one aiohttp session and at most
`--concurrency` at a time (default: all at once):

* `--requests` streaming requests, a shuffled mix of `/v1/completions` SSE,
  `/v1/chat/completions` SSE and `/generate` NDJSON, each with a random
  `max_tokens` in 1..32 and `ignore_eos: true`, so its length is known;
  `--disconnects` of them are closed by the client after a random number of
  events (zero: right after the headers);
* `--malformed` bad requests (invalid JSON, wrong types, negative
  max_tokens, an unknown model, out-of-range sampling values, ...), each
  with the field the server must name (`loadtest_cases.py`).

Before them, two probes: a `--big-prompt-mib` prompt (default 8 MiB) to
`/v1/completions`, which must be a 4xx naming `prompt` while `/health`,
polled meanwhile, answers each time in under 100 ms; and poisoned
neighbours: for each route one request with a field past any bound (such as
`top_k: 2**63`), sent in a burst with `--poison-neighbours` good streams
(default 20), which must all complete while it alone gets its 4xx.

Checks: every stream that was not cut got exactly max_tokens tokens
(`usage.completion_tokens`; NDJSON also by its `token_ids`),
`finish_reason: "length"` and a proper end (`data: [DONE]` last for SSE, a
`finished` line last for NDJSON); every malformed request got a 4xx whose
JSON `error.param` is the expected field; no response was a 5xx; and after
the run /metrics settles (polled for `--settle` seconds) to
`mstar_kv_pages_in_use` 0, `mstar_tensors_held` 0 and
`mstar_requests_running` 0, with no request finished as `error`.

Against a server whose model answers in speech only (its /health says
`audio_logits_only`), every stream and every good neighbour is a speech
request, and the big prompt is a speech input (a 4xx naming `input`); the
malformed and poisoned requests keep their text routes, which validate a
request before they refuse it.

With a bounded waiting line (`--server-args "--max-waiting-requests N
--queue-timeout S"`), requests past it get 429; each must carry Retry-After,
and the client sends the request again after it (at most 5 s), so a refused
request is delayed, not lost.

The run is bounded: no request starts after `--seconds`, and every request
in flight is cut at that deadline (it then counts as lost). Prints requests
per second, latency p50/p99, and the counts of lost requests, 5xx and
leaked pages; exits 1 if any check fails.

    python scripts/loadtest.py                                   # tiny-llama on CPU, the defaults
    python scripts/loadtest.py --url http://127.0.0.1:8000 --requests 50 --disconnects 10 --malformed 20
    python scripts/loadtest.py --server-args "--max-waiting-requests 50 --queue-timeout 0.2"   # overload: 429s
    python scripts/loadtest.py --model orpheus-tiny --requests 100 --disconnects 20 --malformed 50 --speech 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# sibling module (the script's folder is first on sys.path): the server
# subprocess, its health wait and the uvloop runner are shared, not copied
from bench_server import Server, add_server_args, on_sigterm, run_async, start_server, wait_healthy
from loadtest_cases import MALFORMED, POISONED, big_prompt
from loadtest_checks import SPEECH_ROUTE, check_error, check_stream
from prometheus_samples import Samples, samples, total, totals

MAX_TOKENS = 32
PROMPTS = ("Hello", "The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4 5",
           "Tell me about the weather today.")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
SPEECH_MAX_TOKENS = 70  # ten 7-token frames: a few audio windows per stream

@dataclass
class Job:
    """One request to send and what its answer must be."""

    kind: str  # "stream", "disconnect" or "malformed"
    route: str
    body: bytes
    max_tokens: int = 0
    cut_after: int = -1  # disconnects: close after this many events
    expect_param: str = ""


@dataclass
class Outcome:
    """What happened to one job; `problem` is empty when it passed its checks."""

    job: Job
    status: int = 0
    latency_s: float = 0.0
    cut: bool = False  # the client closed it mid-stream, as planned
    problem: str = ""
    refusals: int = 0  # 429/503 answers (each with Retry-After) before it got in


@dataclass
class Tally:
    """Every outcome of a run, the jobs the deadline kept from starting, and its wall time."""

    outcomes: list[Outcome] = field(default_factory=list)
    not_started: int = 0
    wall_s: float = 0.0


def stream_body(route: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streaming body for `route` whose length is fixed by max_tokens."""
    if route == "/generate":
        # the text walk by name: a speech model's default walk answers with audio
        return {"model": model, "text": prompt, "stream": True, "walk": "generate",
                "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
    if route == SPEECH_ROUTE:
        return {"model": model, "input": prompt, "voice": "tara", "response_format": "pcm", "stream_format": "sse",
                "max_tokens": max_tokens, "ignore_eos": True}
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                            # the totals in a last chunk: SSE text pieces need not be one per token
                            "stream_options": {"include_usage": True}}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def make_jobs(a: argparse.Namespace, model: str, rng: random.Random, speech_only: bool = False) -> list[Job]:
    """Streams, disconnects and malformed requests, shuffled so every kind
    overlaps every other. `speech_only` (a server whose model answers in
    speech only, `--audio-logits-only`): every stream is a speech request."""
    jobs: list[Job] = []
    speech = a.requests if speech_only else getattr(a, "speech", 0)
    every = a.requests // speech if speech else 0
    for i in range(a.requests):
        if every and i % every == 0 and i // every < speech:
            route, n = SPEECH_ROUTE, rng.randint(1, SPEECH_MAX_TOKENS)
        else:
            route, n = ROUTES[i % len(ROUTES)], rng.randint(1, MAX_TOKENS)
        body = json.dumps(stream_body(route, model, rng.choice(PROMPTS), n)).encode()
        if i < a.disconnects:
            # text SSE and NDJSON send at least n + 1 events, so any cut in 0..n lands before the end; speech
            # sends an event a 7-token frame once its first 4-frame window played, and one for a short tail
            most = max(1, n // 7 - 2) if route == SPEECH_ROUTE else n
            jobs.append(Job("disconnect", route, body, n, cut_after=rng.randint(0, most)))
        else:
            jobs.append(Job("stream", route, body, n))
    jobs += [malformed_job(MALFORMED[i % len(MALFORMED)], model) for i in range(a.malformed)]
    rng.shuffle(jobs)
    return jobs


def malformed_job(case: tuple[str, Any, str], model: str) -> Job:
    route, bad, param = case
    if not isinstance(bad, bytes):
        if isinstance(bad, dict) and route != "/generate":
            bad = {"model": model, **bad}  # the one wrong thing is the one named
        bad = json.dumps(bad).encode()
    return Job("malformed", route, bad, expect_param=param)


def poison_bursts(model: str, neighbours: int, rng: random.Random, speech_only: bool = False) -> list[list[Job]]:
    """For each poisoned case, one burst: it and `neighbours` good streams of
    its route (of speech on a server that answers in speech only: its text
    routes still validate a request before they refuse it)."""
    bursts = []
    for case in POISONED:
        route = SPEECH_ROUTE if speech_only else case[0]
        most = SPEECH_MAX_TOKENS if route == SPEECH_ROUTE else MAX_TOKENS
        good = [Job("stream", route, json.dumps(stream_body(route, model, rng.choice(PROMPTS), n)).encode(), n)
                for n in (rng.randint(1, most) for _ in range(neighbours))]
        bursts.append([malformed_job(case, model), *good])
    return bursts


async def read_events(resp: aiohttp.ClientResponse, route: str, cut_after: int) -> tuple[list[Any], bool]:
    """The stream's events (parsed JSON, or "[DONE]") and whether we cut it.
    A cut closes the connection itself, so the server sees the client leave."""
    events: list[Any] = []
    if cut_after == 0:
        resp.close()
        return events, True
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        if route != "/generate":
            if not line.startswith("data: "):
                raise ValueError(f"not an SSE data line: {line[:80]!r}")
            line = line[len("data: "):]
        events.append("[DONE]" if line == "[DONE]" else json.loads(line))
        if 0 < cut_after <= len(events):
            break
    else:
        return events, False  # the server ended the stream first
    if resp.content.at_eof():
        return events, False
    resp.close()
    return events, True


RETRY_CAP_S = 5.0  # the longest a refused job waits before its next try, whatever Retry-After says


async def run_job(session: aiohttp.ClientSession, url: str, job: Job, deadline: float) -> Outcome:
    """Send one job and judge its answer; never raises for its own failures.
    A 429 or 503 must carry Retry-After; the job is sent again after it, until
    the deadline."""
    out = Outcome(job)
    t0 = time.monotonic()
    try:
        while True:
            timeout = aiohttp.ClientTimeout(total=max(deadline - time.monotonic(), 0.001))
            async with session.post(url + job.route, data=job.body, timeout=timeout,
                                    headers={"Content-Type": "application/json"}) as r:
                out.status = r.status
                if r.status in (429, 503):
                    retry = r.headers.get("Retry-After")
                    if retry is None or not retry.isdigit():
                        out.problem = f"HTTP {r.status} without a Retry-After header"
                        break
                    out.refusals += 1
                    await r.read()
                else:
                    if job.kind == "malformed":
                        out.problem = check_error(r.status, await r.text(errors="replace"), job.expect_param)
                    elif r.status != 200:
                        out.problem = f"HTTP {r.status}: {(await r.text(errors='replace'))[:200]}"
                    else:
                        events, out.cut = await read_events(r, job.route, job.cut_after)
                        if not out.cut:  # a disconnect whose stream ended first is judged as a whole one
                            out.problem = check_stream(job.route, events, job.max_tokens)
                    break
            wait = min(float(retry), RETRY_CAP_S)
            if time.monotonic() + wait >= deadline:
                out.problem = f"still refused ({out.refusals} times) at the deadline"
                break
            await asyncio.sleep(wait)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        out.problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    out.latency_s = time.monotonic() - t0
    return out


async def fire(url: str, jobs: list[Job], a: argparse.Namespace) -> Tally:
    """Every job, at most `a.concurrency` at a time, none started after the deadline."""
    tally = Tally()
    sem = asyncio.Semaphore(a.concurrency)
    start = time.monotonic()
    deadline = start + a.seconds

    async def one(job: Job) -> None:
        async with sem:
            if time.monotonic() >= deadline:
                tally.not_started += 1
                return
            tally.outcomes.append(await run_job(session, url, job, deadline))

    # limit=0: aiohttp's default pool of 100 would queue requests inside the client
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(j) for j in jobs))
    tally.wall_s = time.monotonic() - start
    return tally


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return samples(await r.text())


async def settle(session: aiohttp.ClientSession, url: str, seconds: float) -> Samples:
    """Poll /metrics until nothing is held or `seconds` pass: aborts of cut
    streams reach the workers a step or so after the client left."""
    end = time.monotonic() + seconds
    while True:
        found = await scrape(session, url)
        m = totals(found)  # summed over devices, components and a front's replicas
        held = (m.get("mstar_kv_pages_in_use", 0), m.get("mstar_tensors_held", 0), m.get("mstar_requests_running", 0))
        if not any(held) or time.monotonic() >= end:
            return found
        await asyncio.sleep(0.25)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; 0 for no data."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def report(tally: Tally, before: Samples, after: Samples, own_server: bool) -> list[str]:
    """Print the figures; the failed checks."""
    outs = tally.outcomes
    streams = [o for o in outs if o.job.kind != "malformed"]
    cut = [o for o in streams if o.cut]
    done = [o for o in streams if not o.cut and not o.problem]
    lost = [o for o in streams if not o.cut and o.problem]  # includes planned disconnects that never got to cut
    bad = [o for o in outs if o.job.kind == "malformed"]
    bad_wrong = [o for o in bad if o.problem]
    five = [o for o in outs if o.status >= 500 and o.status != 503]
    refused = [o for o in outs if o.refusals]
    lat = [o.latency_s for o in done]
    # -1: the server did not report it (a check that then fails rather than passes on a missing gauge)
    held = totals(after)
    pages = held.get("mstar_kv_pages_in_use", -1)
    tensors = held.get("mstar_tensors_held", -1)
    running = held.get("mstar_requests_running", -1)
    finished = {s: total(after, "mstar_requests_total", status=s) - total(before, "mstar_requests_total", status=s)
                for s in ("stop", "length", "abort", "error")}

    print(f"requests sent       {len(outs)} in {tally.wall_s:.1f} s ({len(outs) / max(tally.wall_s, 1e-9):.1f} req/s), "
          f"{tally.not_started} not started before the deadline")
    print(f"streams completed   {len(done)}  latency p50 {percentile(lat, 50) * 1e3:.0f} ms, "
          f"p99 {percentile(lat, 99) * 1e3:.0f} ms; {sum(o.job.max_tokens for o in done)} tokens")
    print(f"streams cut         {len(cut)} (by the client, mid-stream)")
    print(f"lost                {len(lost)}")
    print(f"malformed           {len(bad)}: {len(bad) - len(bad_wrong)} answered 4xx naming the field, "
          f"{len(bad_wrong)} not")
    print(f"refused             {sum(o.refusals for o in outs)} answers 429/503 with Retry-After, to "
          f"{len(refused)} requests, which then retried")
    print(f"5xx                 {len(five)} (503 with Retry-After counts as refused)")
    print(f"metrics after       kv_pages_in_use {pages:g} (leaked pages), tensors_held {tensors:g}, "
          f"requests_running {running:g}; preemptions "
          f"{total(after, 'mstar_preemptions_total') - total(before, 'mstar_preemptions_total'):g} (this run)")
    print("requests finished   " + ", ".join(f"{s} {n:g}" for s, n in finished.items()) + " (this run)")
    for label, group in (("lost", lost), ("malformed", bad_wrong)):
        for o in group[:5]:
            print(f"  {label}: {o.job.kind} {o.job.route} max_tokens={o.job.max_tokens}: {o.problem}")

    failures = []
    if tally.not_started:
        failures.append(f"{tally.not_started} requests not started within --seconds")
    if lost:
        failures.append(f"{len(lost)} lost requests")
    if bad_wrong:
        failures.append(f"{len(bad_wrong)} malformed requests not answered 4xx naming the field")
    if five:
        failures.append(f"{len(five)} 5xx responses")
    if pages != 0:
        failures.append(f"kv_pages_in_use {pages:g}")
    if tensors != 0:
        failures.append(f"tensors_held {tensors:g}")
    if running != 0:
        failures.append(f"requests_running {running:g}")
    if finished["error"]:
        failures.append(f"{finished['error']:g} requests finished as error")
    # with our own server nothing else talks to it: every stream that got its
    # headers was submitted, and must have finished once (malformed ones never are)
    submitted = sum(1 for o in streams if o.status == 200)
    if own_server and sum(finished.values()) != submitted:
        failures.append(f"engine finished {sum(finished.values()):g} requests, {submitted} were submitted")
    return failures


async def main_async(a: argparse.Namespace, url: str, server: Server | None) -> list[str]:
    t0 = time.monotonic()
    health = await wait_healthy(url, a.startup_timeout, server)
    model = str(health.get("model") or a.model)
    speech_only = bool(health.get("audio_logits_only"))
    print(f"# server healthy after {time.monotonic() - t0:.1f} s: model {model}"
          f"{' (speech only: every stream is a speech request)' if speech_only else ''}", flush=True)
    rng = random.Random(a.seed)
    jobs = make_jobs(a, model, rng, speech_only)
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, url)
    failures = []
    if a.big_prompt_mib > 0:
        seen = await big_prompt(url, model, a.big_prompt_mib, speech_only)
        health = max(seen.health_s, default=0.0)
        print(f"big prompt          {a.big_prompt_mib:g} MiB: HTTP {seen.status} naming {seen.param!r} after "
              f"{seen.answer_s * 1e3:.0f} ms; /health polled {len(seen.health_s)} times meanwhile, slowest "
              f"{health * 1e3:.1f} ms", flush=True)
        failures += seen.problems()
    poisoned = Tally()
    for burst in poison_bursts(model, a.poison_neighbours, rng, speech_only) if a.poison_neighbours else []:
        part = await fire(url, burst, a)
        poisoned.outcomes += part.outcomes
        poisoned.not_started += part.not_started
    if poisoned.outcomes:
        good = [o for o in poisoned.outcomes if o.job.kind == "stream"]
        print(f"poisoned neighbours {len(POISONED)} bursts of one request with a field past any bound and "
              f"{a.poison_neighbours} good ones: {sum(not o.problem for o in good)}/{len(good)} good completed",
              flush=True)
    print(f"# firing {a.requests} streams ({a.disconnects} cut), {a.malformed} malformed; "
          f"concurrency {a.concurrency}, at most {a.seconds:g} s", flush=True)
    tally = await fire(url, jobs, a)
    tally.outcomes += poisoned.outcomes  # judged with the rest: the good ones complete, the bad one is a 4xx
    tally.not_started += poisoned.not_started
    async with aiohttp.ClientSession() as session:
        after = await settle(session, url, a.settle)
    if server is not None and server.exited() is not None:
        return [f"server exited with status {server.exited()}"]
    return failures + report(tally, before, after, server is not None)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="the server's --model")
    add_server_args(p, startup_timeout=300.0)
    p.add_argument("--requests", type=int, default=500, help="streaming requests")
    p.add_argument("--disconnects", type=int, default=100, help="of --requests, how many the client cuts")
    p.add_argument("--malformed", type=int, default=200, help="bad requests")
    p.add_argument("--speech", type=int, default=0,
                   help="of --requests, how many go to /v1/audio/speech (SSE; the model must speak)")
    p.add_argument("--concurrency", type=int, default=500, help="requests in flight at most")
    p.add_argument("--seconds", type=float, default=300.0, help="no request starts or runs past this")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait for /metrics to show nothing held")
    p.add_argument("--seed", type=int, default=0, help="seeds the mix, lengths and cut points")
    p.add_argument("--poison-neighbours", type=int, default=20,
                   help="good streams sent with each poisoned request (a field past any bound; 0: none)")
    p.add_argument("--big-prompt-mib", type=float, default=8.0,
                   help="first, a prompt this big to /v1/completions while /health is polled (0: none)")
    a = p.parse_args()
    if min(a.requests, a.disconnects, a.malformed) < 0 or a.concurrency < 1 or a.seconds <= 0:
        p.error("counts must be >= 0, --concurrency >= 1, --seconds > 0")
    if a.disconnects > a.requests or not 0 <= a.speech <= a.requests:
        p.error("--disconnects and --speech must be between 0 and --requests")
    return a


def main() -> int:
    a = parse()
    signal.signal(signal.SIGTERM, on_sigterm)  # unwind through `finally`: the server must not outlive us
    url, server, _ = start_server(a, ["--model", a.model], "loadtest_server_")
    t0 = time.monotonic()
    try:
        failures = run_async(main_async(a, url, server))
    finally:
        if server is not None:
            server.stop()
    print(f"# total wall time {time.monotonic() - t0:.1f} s")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
