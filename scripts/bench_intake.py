"""The event loop's CPU time per speech request at intake, on the CPU box:
from an HTTP request reaching aiohttp's handler to `Engine.submit` having
sent it to its worker.

The server is `python -m mstar.http --model orpheus-tiny --gpus cpu` in a
subprocess started through this file's launcher (`serve` as the first
argument). The launcher puts in `bench_host_speech.py`'s stand-ins for the
model's heavy compute (the worker stays cheap beside the intake) and notes,
on the event loop, with `time.thread_time()` (the loop thread's CPU only):
- `span`: each `POST /v1/audio/speech`'s own CPU, from the start of
  aiohttp's `RequestHandler._handle_request` (the middlewares, the route,
  the body's parse, `Engine.prepare`) to the return of `Engine.submit`:
  only the steps of its handler task count (its coroutine's every step
  timed), not what the loop ran between them while the handler waited for
  its body;
- `span wall`: the wall time of the same steps: their CPU, and any wait for
  the GIL (from a call that lets it go, or the switch interval) while the
  worker wanted it; with `--background` streams the worker steps in Python
  throughout, as it does on a GPU under load;
- `tail`: the rest of the handler's step in which it submitted, until it
  first waits for audio (the `Submission` made, its chunks' iterator
  begun): the loop runs the next request's intake only after it;
- `loop`: per burst, the loop thread's CPU from the first bytes of the
  burst's first request to its last submit, over the burst's requests: the
  span plus aiohttp's own share (the HTTP parse, the connection's task,
  the request object) and anything else the loop did meanwhile;
- `worker`: per burst, the device workers' CPU over the same window, over
  the burst's requests (each Submit wakes a worker, which takes the GIL to
  apply it);
- `gap`: the wall time between consecutive submits of a burst (the
  spacing at which a burst reaches the engine).
At exit (the benchmark's SIGTERM) it writes them as JSON to
`$BENCH_INTAKE_OUT`; with `--profile`, also a cProfile (CPU time) of the
spans and tails only (on during each step of a span's task), whose top
functions this prints. The profiler's own cost inflates that run's
numbers: take the clean ones from a run without it.

The client (this process, on uvloop when installed) sends `--bursts` bursts
of `--requests` concurrent speech requests (bench_tts.py's sentences, voice
tara, `response_format: "pcm"`, `ignore_eos`, `max_tokens: --tokens`) as
raw HTTP/1.1, one per kept-alive connection, all of a burst's written in
one go (its own CPU meanwhile is small: on the 2-core box it shares the
cores with the server), each answer read to its end, with a pause between
bursts; the first `--warmup` bursts are not counted. With `--background N`,
N more connections each run one long speech stream after another
throughout (their requests are not noted; the `loop` figure then also
holds their streaming). The server's `--admission-gather-ms` defaults here
to 45 ms: a burst's prompts wait for the whole burst (50 ms at most), so no
step and no report runs on the loop during the intake it measures.

The CPU box is a VM on a shared host: a run's medians move by 15-20 % from
one run to the next. Compare two trees by alternating runs of each (`--out`
keeps a run's figures as JSON), not by one run apiece.

    PYTHONPATH=. python scripts/bench_intake.py --requests 64 --bursts 12
    PYTHONPATH=. python scripts/bench_intake.py --requests 64 --bursts 12 --background 16
    PYTHONPATH=. python scripts/bench_intake.py --requests 64 --bursts 6 --profile /tmp/intake.pstats
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


# sibling modules: the script's folder is first on sys.path (the launcher's too)
from bench_env import REPO, commit, version
from bench_server import Server, free_port, run_async, wait_healthy
from bench_tts import SENTENCES

SERVE = "serve"  # argv[1] that makes this file the server's launcher
OUT_ENV = "BENCH_INTAKE_OUT"  # where the launcher writes its notes at exit
PROFILE_ENV = "BENCH_INTAKE_PROFILE"  # set: the launcher profiles the spans into this file
SPEECH = "/v1/audio/speech"
BACKGROUND = "X-Bench-Background"  # a background stream's request: not noted
BURST_GAP_S = 0.1  # notes further apart than this start a new burst


# -- the server side: the launcher and its notes

class Span:
    """One request's intake: the CPU of its handler task's own steps, from
    the handler's start to the end of its submit, and after it the rest of
    that step (until the handler first waits for audio)."""

    __slots__ = ("cpu", "wall", "before", "step_at", "wall_at", "steps", "note")

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0  # the same steps' wall time: their CPU plus any wait for the GIL
        self.wall_at = 0.0
        self.before = 0.0  # of `cpu`, what ran before the route's handler began (aiohttp, the middlewares)
        self.step_at: float | None = None  # thread_time at the start of the step running now
        self.steps = 0
        self.note: dict[str, Any] | None = None  # its submit's note, once submitted


class Timed:
    """A coroutine's steps timed into `span`, up to the end of the step in
    which it submitted (the task drives `send` / `throw`: each call is one
    step of the coroutine)."""

    def __init__(self, coro: Any, span: Span, probe: Probe) -> None:
        self.coro, self.span, self.probe = coro, span, probe

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        return self._step(self.coro.send, value)

    def throw(self, *exc: Any) -> Any:
        return self._step(self.coro.throw, *exc)

    def close(self) -> None:
        self.coro.close()

    def _step(self, fn: Any, *args: Any) -> Any:
        span = self.span
        if span.note is not None:
            return fn(*args)
        span.steps += 1
        self.probe.profiling(True)
        span.wall_at = time.perf_counter()
        span.step_at = time.thread_time()
        try:
            return fn(*args)
        finally:
            now = time.thread_time()
            self.probe.profiling(False)
            if span.note is None:
                span.cpu += now - span.step_at
                span.wall += time.perf_counter() - span.wall_at
            elif "tail" not in span.note:
                span.note["tail"] = now - span.note["cpu"]
            span.step_at = None


class Probe:
    """What the launcher notes on the event loop: a note per connection's
    bytes received and per speech request submitted (`kind`, `wall`
    perf_counter, `cpu` the loop thread's; a submit's `span`, `before`,
    `tail` and `steps`, see `Span`)."""

    def __init__(self, profile: str | None) -> None:
        self.notes: list[dict[str, Any]] = []
        self.spans: dict[Any, Span] = {}  # the handler task's span, until its submit
        self.engine: Any = None  # the engine, from its first submit
        self.profile_path = profile
        self.profiler: Any = None
        if profile:
            import cProfile
            self.profiler = cProfile.Profile(time.thread_time)  # CPU: not the waits for the GIL

    def received(self) -> None:
        self.notes.append({"kind": "recv", "wall": time.perf_counter(), "cpu": time.thread_time(),
                           "worker_cpu": self.worker_cpu()})

    def worker_cpu(self) -> float:
        """The device workers' CPU so far (0 until the engine's first submit)."""
        return sum(w.cpu_s() for w in self.engine.workers) if self.engine is not None else 0.0

    def profiling(self, on: bool) -> None:
        if self.profiler is not None:
            self.profiler.enable() if on else self.profiler.disable()

    def begin(self, coro: Any) -> Timed:
        span = self.spans[asyncio.current_task()] = Span()
        return Timed(coro, span, self)

    def route(self) -> None:
        span = self.spans.get(asyncio.current_task())
        if span is not None and span.step_at is not None:
            span.before = span.cpu + time.thread_time() - span.step_at

    def end(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        span = self.spans.pop(asyncio.current_task(), None)
        if span is None or span.step_at is None:  # not a speech request's (another route's submit)
            return
        span.cpu += cpu - span.step_at
        span.wall += wall - span.wall_at
        span.note = {"kind": "submit", "wall": wall, "cpu": cpu, "worker_cpu": self.worker_cpu(),
                     "span": span.cpu, "span_wall": span.wall,
                     "before": span.before, "steps": span.steps}
        self.notes.append(span.note)

    def dump(self, path: str) -> None:
        Path(path).write_text(json.dumps({"notes": self.notes}))
        if self.profiler is not None and self.profile_path:
            self.profiler.dump_stats(self.profile_path)


def instrument(probe: Probe) -> None:
    """The notes' hooks: aiohttp's request handling, the server's connection
    protocol, the speech route (before the app is built) and the engine's submit."""
    from aiohttp import web_protocol

    from mstar.engine.engine import Engine
    from mstar.http.deadlines import HeadDeadlineHandler
    from mstar.http.speech import routes as speech_routes

    speech = speech_routes.speech

    async def route(request: Any) -> Any:
        probe.route()
        return await speech(request)

    handle_request = web_protocol.RequestHandler._handle_request

    async def handle(self: Any, request: Any, start_time: Any, request_handler: Any) -> Any:
        coro = handle_request(self, request, start_time, request_handler)
        if request.method == "POST" and request.path == SPEECH and BACKGROUND not in request.headers:
            return await probe.begin(coro)
        return await coro

    data_received = HeadDeadlineHandler.data_received

    def received(self: Any, data: bytes) -> None:
        probe.received()
        data_received(self, data)

    submit = Engine.submit

    def submitted(self: Any, request: Any, prepared: Any = None) -> Any:
        probe.engine = self
        try:
            return submit(self, request, prepared)
        finally:
            probe.end()

    web_protocol.RequestHandler._handle_request = handle  # type: ignore[method-assign]
    HeadDeadlineHandler.data_received = received  # type: ignore[method-assign]
    Engine.submit = submitted  # type: ignore[method-assign]
    speech_routes.speech = route  # type: ignore[assignment]


def serve(argv: list[str]) -> int:
    """The launcher: the stand-ins, the notes, then `python -m mstar.http argv`."""
    import torch

    from bench_host_speech import apply_stubs

    torch.set_num_threads(1)
    apply_stubs(dict.fromkeys(("head", "sample", "attend", "window"), 0), None)
    probe = Probe(os.environ.get(PROFILE_ENV))
    instrument(probe)
    out = os.environ.get(OUT_ENV)
    if out:
        atexit.register(probe.dump, out)
    import mstar.http.__main__ as http_main
    return http_main.main(argv)


# -- the client side: raw HTTP/1.1 on kept-alive connections, so that the
# client's own CPU during a burst is a send per request, not an HTTP library's

class Connection:
    """One kept-alive connection sending one speech request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, request: bytes) -> None:
        self.writer.write(request)

    async def answer(self) -> str | None:
        """The answer read to its end; None if it was a 200, else what it said."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in
                  (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        if fields.get(b"transfer-encoding") == b"chunked":
            body = bytearray()
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                body += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")  # the chunked body's last (empty) line
        else:
            body = bytearray(await self.reader.readexactly(int(fields.get(b"content-length", b"0"))))
        return None if status == 200 else f"HTTP {status}: {bytes(body[:200])!r}"


def speech_request(port: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    more = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {SPEECH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{more}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def speech_body(i: int, tokens: int) -> bytes:
    return json.dumps({"model": "orpheus-tiny", "input": SENTENCES[i % len(SENTENCES)], "voice": "tara",
                       "response_format": "pcm", "max_tokens": tokens, "ignore_eos": True}).encode()


async def background(conn: Connection, request: bytes, errors: list[str]) -> None:
    """One stream after another on `conn` until cancelled: the worker keeps stepping meanwhile."""
    while True:
        conn.send(request)
        error = await conn.answer()
        if error is not None:
            errors.append(error)
            await asyncio.sleep(0.5)


async def client(a: argparse.Namespace, url: str, port: int, server: Server) -> list[str]:
    """Every burst's requests written in one go (one per connection), then every answer read; the background
    streams, if any, run throughout."""
    requests = [speech_request(port, speech_body(i, a.tokens)) for i in range(a.requests)]
    await wait_healthy(url, a.startup_timeout, server)
    conns = [Connection(*await asyncio.open_connection("127.0.0.1", port)) for _ in requests]
    errors: list[str] = []
    streams = []
    for i in range(a.background):
        conn = Connection(*await asyncio.open_connection("127.0.0.1", port))
        request = speech_request(port, speech_body(i, a.background_tokens), {BACKGROUND: "1"})
        streams.append(asyncio.create_task(background(conn, request, errors)))
        conns.append(conn)
    try:
        if streams:
            await asyncio.sleep(2.0)  # the background streams running before the first burst
        for _ in range(a.warmup + a.bursts):
            for c, r in zip(conns, requests):
                c.send(r)
            answers = await asyncio.wait_for(asyncio.gather(*(c.answer() for c in conns[:len(requests)])), 120)
            errors += [e for e in answers if e is not None]
            await asyncio.sleep(a.pause)
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        for c in conns:
            c.writer.close()
    return errors


def bursts(notes: list[dict[str, Any]], requests: int) -> list[list[dict[str, Any]]]:
    """The notes split where they pause; only bursts of `requests` submits."""
    out: list[list[dict[str, Any]]] = []
    for n in notes:
        if not out or n["wall"] - out[-1][-1]["wall"] > BURST_GAP_S:
            out.append([])
        out[-1].append(n)
    return [b for b in out if sum(n["kind"] == "submit" for n in b) == requests]


def summary(notes: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Per-request figures (us) over the counted bursts (the warm-up's dropped)."""
    counted = bursts(notes, a.requests)[a.warmup:]
    if not counted:
        raise SystemExit(f"no burst of {a.requests} submits was noted; see the server's log")
    submits = [n for b in counted for n in b if n["kind"] == "submit"]
    loop, worker, gaps = [], [], []
    for b in counted:
        mine = [n for n in b if n["kind"] == "submit"]
        first = next(n for n in b if n["kind"] == "recv")
        loop.append(1e6 * (mine[-1]["cpu"] - first["cpu"]) / len(mine))
        worker.append(1e6 * (mine[-1]["worker_cpu"] - first["worker_cpu"]) / len(mine))
        gaps += [1e6 * (y["wall"] - x["wall"]) for x, y in zip(mine, mine[1:])]

    def us(key: str) -> list[float]:
        return [1e6 * n.get(key, 0.0) for n in submits]

    spans, walls = us("span"), us("span_wall")
    return {"bursts": len(counted), "requests": len(submits),
            "steps_mean": statistics.fmean(n["steps"] for n in submits),
            "span_us_median": statistics.median(spans), "span_us_mean": statistics.fmean(spans),
            "span_us_p10": quantile(spans, 10), "span_us_p90": quantile(spans, 90),
            "span_wall_us_median": statistics.median(walls), "span_wall_us_mean": statistics.fmean(walls),
            "span_wall_us_p99": quantile(walls, 99),
            "before_route_us_median": statistics.median(us("before")),
            "tail_us_median": statistics.median(us("tail")),
            "loop_us_per_request_median": statistics.median(loop), "loop_us_per_request_min": min(loop),
            "worker_us_per_request_median": statistics.median(worker),
            "gap_us_median": statistics.median(gaps) if gaps else 0.0}


def quantile(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


def print_profile(path: str, top: int) -> None:
    import pstats

    stats = pstats.Stats(path)
    print(f"# cProfile (CPU time) of every burst's spans and tails, the warm-up's included: top {top} by own time, "
          "then by cumulative time")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def environment() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"python {sys.version.split()[0]} | aiohttp {version('aiohttp')} | structlog {version('structlog')} | "
            f"cpus {os.cpu_count()} | load avg {load} | mstar {commit(REPO)}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="concurrent speech requests a burst")
    p.add_argument("--bursts", type=int, default=12, help="bursts counted")
    p.add_argument("--warmup", type=int, default=2, help="bursts first, not counted")
    p.add_argument("--tokens", type=int, default=28, help="max_tokens of every request (ignore_eos)")
    p.add_argument("--pause", type=float, default=0.3, help="seconds between bursts")
    p.add_argument("--background", type=int, default=0,
                   help="speech streams running throughout, one after another on each of as many connections, "
                        "so that the worker steps (in Python, under the GIL) while the bursts come in")
    p.add_argument("--background-tokens", type=int, default=1500, help="max_tokens of a background stream")
    p.add_argument("--gather-ms", type=float, default=45.0, help="the server's --admission-gather-ms")
    p.add_argument("--log-level", default="info", help="the server's --log-level")
    p.add_argument("--server-args", default="", help="more arguments for mstar.http, one string")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temp file)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for /health")
    p.add_argument("--profile", default=None, metavar="FILE", help="cProfile the spans into FILE (.pstats)")
    p.add_argument("--top", type=int, default=35, help="functions the profile prints")
    p.add_argument("--out", type=Path, default=None, help="also write the summary and environment as JSON")
    p.add_argument("--notes", type=Path, default=None, help="also keep the server's raw notes (JSON) here")
    a = p.parse_args()
    if a.requests < 1 or a.bursts < 1 or a.warmup < 0 or a.tokens < 7:
        p.error("--requests >= 1, --bursts >= 1, --warmup >= 0, --tokens >= 7 (a frame)")
    return a


def main() -> None:
    a = parse()
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), SERVE, "--model", "orpheus-tiny", "--gpus", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max(a.requests + a.background, 256)),
            "--admission-gather-ms", str(a.gather_ms), "--log-level", a.log_level, *shlex.split(a.server_args)]
    log = a.server_log or Path(tempfile.mkstemp(prefix="bench_intake_", suffix=".log")[1])
    print(f"# server: {' '.join(argv[1:])} (log: {log})", flush=True)
    print("# " + environment(), flush=True)
    with tempfile.NamedTemporaryFile(prefix="bench_intake_", suffix=".json") as f:
        env = {OUT_ENV: f.name, **({PROFILE_ENV: str(Path(a.profile).resolve())} if a.profile else {})}
        server = Server(argv, log, env)
        server.start()
        try:
            errors = run_async(client(a, f"http://127.0.0.1:{port}", port, server))
        finally:
            server.stop()
        raw = Path(f.name).read_text() or "{}"
    if a.notes:
        a.notes.write_text(raw)
    notes = json.loads(raw).get("notes", [])
    if errors:
        print(f"# {len(errors)} failed requests; the first: {errors[0]}", flush=True)
    s = summary(notes, a)
    print(f"# {s['bursts']} bursts of {a.requests} concurrent speech requests ({s['requests']} counted; a span "
          f"took {s['steps_mean']:.2f} task steps on average); us = event-loop thread CPU")
    print(f"span us/request (handler start -> submitted): median {s['span_us_median']:.1f}  "
          f"mean {s['span_us_mean']:.1f}  p10 {s['span_us_p10']:.1f}  p90 {s['span_us_p90']:.1f}")
    print(f"span wall us/request (the same steps, GIL waits included): median {s['span_wall_us_median']:.1f}  "
          f"mean {s['span_wall_us_mean']:.1f}  p99 {s['span_wall_us_p99']:.1f}")
    print(f"  of the span, before the route's handler (aiohttp, middlewares): median {s['before_route_us_median']:.1f}")
    print(f"  after the submit, the rest of that step (until it waits for audio): median {s['tail_us_median']:.1f}")
    print(f"loop us/request over a burst (first bytes -> last submit): median {s['loop_us_per_request_median']:.1f}"
          f"  min {s['loop_us_per_request_min']:.1f}")
    print(f"worker us/request over the same window (the device workers' CPU, under the same GIL): median "
          f"{s['worker_us_per_request_median']:.1f}")
    print(f"submit gap (wall): median {s['gap_us_median']:.1f} us", flush=True)
    if a.profile:
        print_profile(a.profile, a.top)
    if a.out:
        a.out.write_text(json.dumps({"environment": environment(), "args": {k: str(v) for k, v in vars(a).items()},
                                     "summary": s, "errors": len(errors)}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == [SERVE]:
        sys.exit(serve(sys.argv[2:]))
    main()
