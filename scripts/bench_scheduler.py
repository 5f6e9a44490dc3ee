"""What admitting new requests costs running speech streams: Orpheus over
loopback HTTP, `--streams` long streams running, then new requests arriving.

Starts the server itself (`python -m mstar.http --model orpheus-3b
--load-format dummy --gpus 0`, plus `--server-args`) or targets `--url`.
Phases, one after the other:
  alone     `--alone` short requests one at a time: the one-stream TTFA;
  steady    `--streams` clients in a closed loop of long requests
            (`--stream-tokens` each), measured for `--seconds` once all
            have played and `--settle` seconds more: the gaps between
            their audio chunks; then these clients stop;
  arrivals  `--streams` new clients the same way, measured from the same
            point of their streams (so a decode step reads as much KV as
            in the steady phase), plus a new short request every
            `--every` seconds (open loop): the running streams' gaps
            again, and the new requests' TTFA;
  control   with `--control-streams N`, between the two: N streams and no
            arrivals, measured the same way (the rows alone, without admissions);
  long      the arrivals' background, plus one `--long-prompt`-token prompt
            (`/generate`, random ids, 2 new tokens; with `--long-speech` a speech
            request of as many characters, for a server of speech walks only,
            `--audio-logits-only`: the dummy checkpoint's byte tokenizer makes
            a token of each): the running streams'
            chunks that came after their player ran dry (stalls) while
            it was admitted, and their largest gap then.
A gap is the time between two chunks of one request (its first chunk
excluded: that is its TTFA). Goals (the scheduler issue): p99 gap with
arrivals <= 1.2x without; the arrivals' TTFA p50 <= 1.5x one stream's; no
stall during the long prompt.

    PYTHONPATH=. python scripts/bench_scheduler.py --out docs/benchmarks/scheduler.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench_server import Server, add_server_args, on_sigterm, run_async, start_server, wait_healthy
from bench_tts import SENTENCES, speak
from tts_report import SAMPLE_BYTES, Stream, environment, percentile


def _body(a: argparse.Namespace, model: str, n: int, tokens: int) -> dict[str, Any]:
    return {"model": model, "input": SENTENCES[n % len(SENTENCES)], "voice": a.voice, "response_format": "pcm",
            "max_tokens": tokens, "ignore_eos": True}


def _gaps(streams: list[Stream], start: float, end: float) -> list[float]:
    """Gaps between consecutive chunks of each request that end in [start, end)."""
    out = []
    for s in streams:
        for before, at in zip(s.arrivals, s.arrivals[1:]):
            if start <= at < end:
                out.append(at - before)
    return out


def _stalls(streams: list[Stream], start: float, end: float) -> int:
    """Chunks arriving in [start, end) after everything before them had played."""
    late = 0
    for s in streams:
        if s.first_byte is None:
            continue
        dry_at = s.first_byte
        for i, (at, nbytes) in enumerate(zip(s.arrivals, s.sizes)):
            if i and at > dry_at:
                late += start <= at < end
                dry_at = at
            dry_at += nbytes / SAMPLE_BYTES / s.sample_rate
    return late


class Background:
    """`--streams` clients, each sending its next long request when the last
    ends, until `stop` cancels them."""

    def __init__(self, session: aiohttp.ClientSession, url: str, a: argparse.Namespace, model: str,
                 streams: int | None = None) -> None:
        self.session, self.url, self.a, self.model = session, url, a, model
        self.n = streams or a.streams
        self.streams: list[Stream] = []
        self.tasks: list[asyncio.Task] = []

    async def _client(self, i: int) -> None:
        n = i
        while True:
            stream = Stream(sent=time.perf_counter())
            self.streams.append(stream)
            await speak(self.session, self.url, _body(self.a, self.model, n, self.a.stream_tokens), self.a.timeout,
                        stream)
            n += self.n

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._client(i)) for i in range(self.n)]

    def all_playing(self) -> bool:
        return len(self.streams) >= self.n and all(s.first_byte is not None for s in self.streams)

    async def started(self) -> float:
        """Start the clients; when every one is playing and `--settle` more
        seconds have passed, the time then."""
        self.start()
        while not self.all_playing():
            await asyncio.sleep(0.05)
        await asyncio.sleep(self.a.settle)
        return time.perf_counter()

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _long_prompt(session: aiohttp.ClientSession, url: str, model: str, n: int,
                       speech: bool = False) -> dict[str, float]:
    rng = random.Random(n)
    if speech:
        text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))
        route, body = "/v1/audio/speech", {"model": model, "input": text, "voice": "tara", "response_format": "pcm",
                                           "max_tokens": 2, "ignore_eos": True}
    else:
        # the prompt earlier rows were measured with: one id, n times (a new generator of the same seed for each)
        ids = [random.Random(n).randrange(1000, 100_000) for _ in range(n)]
        route, body = "/generate", {"model": model, "input_ids": ids, "walk": "generate",
                                    "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
    t0 = time.perf_counter()
    async with session.post(f"{url}{route}", json=body) as r:
        body = await (r.read() if speech and r.status == 200 else r.json())
        if r.status != 200:
            raise SystemExit(f"the long prompt failed: HTTP {r.status} {body}")
    return {"sent": t0, "done": time.perf_counter()}


async def _snapshot(session: aiohttp.ClientSession, url: str, a: argparse.Namespace, name: str) -> None:
    """The server's /metrics at a phase boundary, into `--metrics-dir`."""
    if a.metrics_dir is None:
        return
    async with session.get(f"{url}/metrics") as r:
        (a.metrics_dir / f"metrics_{a.label}_{name}.txt").write_text(await r.text())


async def _profile(session: aiohttp.ClientSession, url: str, a: argparse.Namespace, name: str) -> None:
    """`--profile` seconds of the worker's steps from a third into a phase
    (POST /debug/profile, ops by Python stack too), into `--metrics-dir`."""
    await asyncio.sleep(a.seconds / 3)
    async with session.post(f"{url}/debug/profile", json={"seconds": a.profile, "rows": 40, "stacks": True}) as r:
        if r.status != 200:
            raise SystemExit(f"the {name} phase's profile failed: HTTP {r.status} {await r.text()}")
        (a.metrics_dir / f"profile_{a.label}_{name}.txt").write_text(await r.text())


async def bench(a: argparse.Namespace, url: str, server: Server | None) -> dict[str, Any]:
    health = await wait_healthy(url, a.startup_timeout, server)
    model = health["model"]
    timeout = aiohttp.ClientTimeout(total=None)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        for n in range(2):  # first-use costs (graph replays, codec) before anything is timed
            await speak(session, url, _body(a, model, n, a.short_tokens), a.timeout)
        alone = [await speak(session, url, _body(a, model, n, a.short_tokens), a.timeout) for n in range(a.alone)]
        # each phase starts its own background at the same offset: the running streams' contexts (the
        # KV each decode step reads) are the same in both, so the gaps differ only by the arrivals
        quiet = Background(session, url, a, model)
        t_steady = await quiet.started()
        await _snapshot(session, url, a, "steady_start")
        profiles = [asyncio.ensure_future(_profile(session, url, a, "steady"))] if a.profile else []
        await asyncio.sleep(a.seconds)
        t_steady_end = time.perf_counter()
        await quiet.stop()
        control: dict[str, float] = {}
        if a.control_streams:  # as many streams as run with arrivals, none arriving: what the rows alone cost
            more = Background(session, url, a, model, a.control_streams)
            t_more = await more.started()
            await asyncio.sleep(a.seconds)
            gaps = _gaps(more.streams, t_more, time.perf_counter())
            await more.stop()
            control = {"control_streams": a.control_streams,
                       "control_gap_p50_ms": round(percentile(gaps, 50) * 1e3, 1),
                       "control_gap_p99_ms": round(percentile(gaps, 99) * 1e3, 1)}
        bg = Background(session, url, a, model)
        t_arrivals = await bg.started()
        await _snapshot(session, url, a, "arrivals_start")
        if a.profile:
            profiles.append(asyncio.ensure_future(_profile(session, url, a, "arrivals")))
        arrivals: list[asyncio.Task] = []
        n = 1000
        while time.perf_counter() - t_arrivals < a.seconds:
            arrivals.append(asyncio.ensure_future(speak(session, url, _body(a, model, n, a.short_tokens), a.timeout)))
            n += 1
            await asyncio.sleep(a.every)
        t_arrivals_end = time.perf_counter()
        await _snapshot(session, url, a, "arrivals_end")
        await asyncio.gather(*profiles)
        arrived = await asyncio.gather(*arrivals)
        await asyncio.sleep(a.settle)
        long = await _long_prompt(session, url, model, a.long_prompt, a.long_speech)
        await asyncio.sleep(a.settle)
        t_long_end = time.perf_counter()
        await bg.stop()
    failed = [s.error for s in [*alone, *arrived, *quiet.streams, *bg.streams] if s.error]
    if not alone or not arrived:
        raise SystemExit("no request was timed")
    steady = _gaps(quiet.streams, t_steady, t_steady_end)
    busy = _gaps(bg.streams, t_arrivals, t_arrivals_end)
    window = (long["sent"], long["done"] + 0.5)  # the prompt's admission, and what follows it
    during = _gaps(bg.streams, *window)
    one = statistics.median(s.ttfa_s for s in alone if s.ok) * 1e3
    new = statistics.median(s.ttfa_s for s in arrived if s.ok) * 1e3
    result = {
        "streams": a.streams, "stream_tokens": a.stream_tokens, "short_tokens": a.short_tokens,
        "every_s": a.every, "seconds": a.seconds, "long_prompt": a.long_prompt,
        "failed": len(failed), "errors": failed[:5],
        "one_stream_ttfa_p50_ms": round(one, 1),
        "arrivals": len(arrived), "arrivals_ttfa_p50_ms": round(new, 1),
        "arrivals_ttfa_p90_ms": round(percentile([s.ttfa_s * 1e3 for s in arrived if s.ok], 90), 1),
        "ttfa_ratio": round(new / one, 2),
        "steady_gap_p50_ms": round(percentile(steady, 50) * 1e3, 1),
        "steady_gap_p99_ms": round(percentile(steady, 99) * 1e3, 1),
        "arrivals_gap_p50_ms": round(percentile(busy, 50) * 1e3, 1),
        "arrivals_gap_p99_ms": round(percentile(busy, 99) * 1e3, 1),
        "gap_p99_ratio": round(percentile(busy, 99) / percentile(steady, 99), 2),
        "long_prompt_s": round(long["done"] - long["sent"], 3),
        "long_prompt_max_gap_ms": round(max(during, default=0.0) * 1e3, 1),
        "long_prompt_stalls": _stalls(bg.streams, *window),
        "stalls_all_phases": _stalls(quiet.streams, t_steady, t_steady_end) + _stalls(bg.streams, t_arrivals,
                                                                                      t_long_end),
        **control,
    }
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--gpus", default="0")
    add_server_args(p, startup_timeout=900.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=2800, help="max_tokens of a background request")
    p.add_argument("--short-tokens", type=int, default=280, help="max_tokens of an arriving request")
    p.add_argument("--every", type=float, default=0.1, help="seconds between arrivals")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the steady and arrivals phases")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between phases")
    p.add_argument("--alone", type=int, default=5)
    p.add_argument("--long-prompt", type=int, default=4000)
    p.add_argument("--long-speech", action="store_true",
                   help="the long prompt as a speech request of --long-prompt characters (a server of speech walks "
                        "only: --audio-logits-only)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--voice", default="tara")
    p.add_argument("--label", default="default", help="the key of this run in --out")
    p.add_argument("--out", type=Path, default=None, help="JSON to add this run to (under --label)")
    p.add_argument("--metrics-dir", type=Path, default=None, help="save /metrics at each phase's start here")
    p.add_argument("--control-streams", type=int, default=0, metavar="N",
                   help="also measure N streams without arrivals (N: the rows the arrivals phase runs, from its "
                        "/metrics): the gaps the rows alone give, against which the arrivals' own cost shows")
    p.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                   help="also profile the worker this long in the steady and arrivals phases (the server runs "
                        "with --enable-profiling; the tables go to --metrics-dir; the profiler slows the phases "
                        "it runs in, so their numbers are not the benchmark's)")
    a = p.parse_args()
    if a.profile and a.metrics_dir is None:
        p.error("--profile writes its tables to --metrics-dir")
    if "--audio-logits-only" in shlex.split(a.server_args or "") and not a.long_speech:
        p.error("a server with --audio-logits-only serves speech walks only: its long prompt needs --long-speech")
    if a.metrics_dir is not None:  # before the server starts: a missing folder would end the run after its load
        a.metrics_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    flags = ["--model", a.model, "--load-format", a.load_format, "--gpus", a.gpus]
    url, server, desc = start_server(a, flags + (["--enable-profiling"] if a.profile else []),
                                     "bench_scheduler_server_")
    try:
        result = run_async(bench(a, url, server))
    finally:
        if server is not None:
            server.stop()
    result["server"] = desc
    result["command"] = "scripts/bench_scheduler.py " + " ".join(sys.argv[1:])
    devices = [f"cuda:{g}" if g.isdigit() else g for g in a.gpus.split(",")]
    result["environment"] = environment(devices, a.model, desc, Path(__file__).resolve().parents[1], {})
    print(json.dumps(result, indent=1))
    if a.out is not None:
        report = json.loads(a.out.read_text()) if a.out.exists() else {}
        report[a.label] = result
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
