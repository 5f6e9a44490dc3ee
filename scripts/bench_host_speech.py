"""The host-side (Python) cost of serving Orpheus speech streams over HTTP, on
the CPU, with the model's heavy compute replaced by cheap stand-ins.

What flows through it: N closed-loop aiohttp clients in this process, each
sending `POST /v1/audio/speech` (bench_tts.py's body: a fixed sentence,
`response_format: "pcm"`, `ignore_eos: true`, `max_tokens: --tokens`) over
loopback and streaming the PCM back, sending its next request as soon as the
last one ended. The server is `python -m mstar.http --model orpheus-tiny
--gpus cpu` in a subprocess started through this file's launcher (`serve`
as the first argument), which monkeypatches, before the engine exists, only
the work a GPU would do:
- the LM head (`VocabHead.forward`): zeros expanded to [T, vocab], no matmul;
- the sampler (`row_sampler.sample`): random ids in Orpheus's audio range, so
  every token enters the codec stream and no audio-end id stops a request;
- attention (`TorchPagedAttention.attend`): q passed through (the plan and
  the KV writes stay);
- the SNAC window (`OrpheusCodec.window`): zeros of the length the real one
  plays (2048 samples for a full window, fewer for a stream's last).
Everything else runs as written: HTTP, the event loop, requests' streams and
outbox, reports, the scheduler, decode groups, finalize, the walk streams.

Per level, after every stream has heard audio, a window of `--seconds`:
counters from the server's `/metrics` (`mstar_batch_size` sums: llm rows,
with `mstar_mixed_rows_total`, = tokens; codec rows = audio chunks), the
bytes clients received (PCM16 at 24 kHz -> audio seconds), and the server's
CPU time from /proc/<pid>/stat
(utime + stime; its main thread, the event loop, apart from the others:
the device worker, torch). The launcher also adds the worker's CPU time in
what is left of the model (`LlamaDecoder.forward` around the stand-ins, the
sampler and window stand-ins: a GPU's work, not the host's) and in
attention plans (the torch backend's; FlashInfer plans on a GPU) to a small
shared file (`$BENCH_HOST_SPEECH_COUNTERS`), read at the window's edges.
`gc ms/s`, `gc2` and `gc2 ms` are the server's garbage collections in the
window (`mstar_gc_pause_seconds`: their pauses a second, the full ones and
a full one's mean pause); `--default-gc` leaves Python's collector as it
is. Then the clients hang up, the server aborts their requests, and
the next level starts once it is idle. `--py-spy PREFIX` records the server's GIL
holders over each window (py-spy --gil --nonblocking, folded stacks); py-spy
takes CPU of its own, so that run's numbers are not the clean ones.
Only measured numbers are printed; on a busy box CPU time per chunk/token
is the steadier figure, throughput depends on what else runs.

    PYTHONPATH=. python scripts/bench_host_speech.py --streams 16 64 256 --seconds 20
    PYTHONPATH=. python scripts/bench_host_speech.py --streams 64 --py-spy /tmp/speech  # /tmp/speech_64.txt
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import mmap
import os
import platform
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

# sibling modules: the script's folder is first on sys.path (the launcher's too)
from bench_env import REPO, commit, version
from bench_server import Server, free_port, run_async, wait_healthy
from bench_tts import SENTENCES
from prometheus_samples import Samples, samples, total

SERVE = "serve"  # argv[1] that makes this file the server's launcher
SAMPLE_RATE = 24_000
PCM_BYTES = 2
CLK_TCK = os.sysconf("SC_CLK_TCK")
COUNTERS_ENV = "BENCH_HOST_SPEECH_COUNTERS"  # the launcher's Counters file
DEFAULT_GC_ENV = "BENCH_HOST_SPEECH_DEFAULT_GC"  # set: the launcher leaves Python's collector as it is
BUCKETS = ("model", "plan")

# -- the server side: the launcher and its stand-ins


class Counters:
    """CPU seconds per bucket as float64s in a shared file: the launcher adds, the benchmark reads."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 8 * len(BUCKETS))

    def add(self, i: int, seconds: float) -> None:
        struct.pack_into("d", self.mm, 8 * i, struct.unpack_from("d", self.mm, 8 * i)[0] + seconds)

    def read(self) -> dict[str, float]:
        return dict(zip(BUCKETS, struct.unpack_from(f"{len(BUCKETS)}d", self.mm)))


def timed(owner: Any, name: str, counters: Counters | None, bucket: str) -> None:
    """`owner.name` adding its thread CPU time to `bucket` of `counters`."""
    fn, i = getattr(owner, name), BUCKETS.index(bucket)
    if counters is None:
        return

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            counters.add(i, time.thread_time() - t0)
    setattr(owner, name, call)


def apply_stubs(hits: dict[str, int], counters: Counters | None) -> None:
    """Replace the model's heavy compute by stand-ins of the same shapes;
    `hits` counts each stand-in's calls (printed at exit, so a run can show
    that its stand-ins were the code that ran). With `counters`: the CPU
    time of what is left of the model (LlamaDecoder.forward with the head and
    attention stubbed, the sampler, the SNAC window) and of attention plans."""
    import torch

    from mstar.engine.execution import row_sampler
    from mstar.engine.execution.backends import TorchBackend
    from mstar.engine.memory.attention import TorchPagedAttention
    from mstar.models.layers.linear import VocabHead
    from mstar.models.llama.model import LlamaDecoder
    from mstar.models.orpheus.codec import WINDOW_TOKENS, OrpheusCodec
    from mstar.models.orpheus.tokens import AUDIO_TOKEN_BASE, AUDIO_TOKEN_END, FRAME_TOKENS

    def head(self: VocabHead, x: torch.Tensor) -> torch.Tensor:
        hits["head"] += 1
        return x.new_zeros(()).expand(*x.shape[:-1], self.out_features)

    def sample(logits: torch.Tensor, st: Any, seen: torch.Tensor | None = None, banned: torch.Tensor | None = None,
               offset: int = 0, window: tuple[int, int] | None = None,
               outputs: torch.Tensor | None = None) -> torch.Tensor:
        hits["sample"] += 1
        return torch.randint(AUDIO_TOKEN_BASE, AUDIO_TOKEN_END, (logits.shape[0],), device=logits.device)

    def attend(self: TorchPagedAttention, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        hits["attend"] += 1
        return q

    def window(self: OrpheusCodec, tokens: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
        # `seeds` stays in the signature: the runner passes per-row seeds to modes that name it
        hits["window"] += 1
        rows, length = tokens.shape
        frames, spf = length // FRAME_TOKENS, self.samples_per_frame
        end = 2 * spf if length == WINDOW_TOKENS else frames * spf
        return torch.zeros(rows, end - spf if frames >= 2 else 0, dtype=torch.float32, device=tokens.device)

    VocabHead.forward = head  # type: ignore[method-assign]
    row_sampler.sample = sample  # type: ignore[assignment]
    TorchPagedAttention.attend = attend  # type: ignore[method-assign]
    OrpheusCodec.window = window  # type: ignore[method-assign]
    timed(LlamaDecoder, "forward", counters, "model")
    timed(row_sampler, "sample", counters, "model")
    timed(OrpheusCodec, "window", counters, "model")
    timed(TorchBackend, "plan", counters, "plan")


def serve(argv: list[str]) -> int:
    """The launcher: `--torch-threads N` (this file's own), the stand-ins, then `python -m mstar.http argv`."""
    import atexit

    import torch

    threads = 1
    if argv[:1] == ["--torch-threads"]:
        threads, argv = int(argv[1]), argv[2:]
    torch.set_num_threads(threads)
    hits = dict.fromkeys(("head", "sample", "attend", "window"), 0)
    path = os.environ.get(COUNTERS_ENV)
    apply_stubs(hits, Counters(path) if path else None)
    atexit.register(lambda: print(f"# stand-in calls: {json.dumps(hits)}", file=sys.stderr, flush=True))
    import mstar.http.__main__ as http_main
    if os.environ.get(DEFAULT_GC_ENV):
        http_main.quiet_gc = lambda: 0
    return http_main.main(argv)


# -- the client side

def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the whole process's, its main thread's) utime + stime in seconds."""
    def read(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


@dataclass
class Snapshot:
    """What is counted at a window's edges."""
    t: float
    cpu_s: float
    main_cpu_s: float
    client_cpu_s: float
    model_s: float
    plan_s: float
    tokens: float
    chunks: float
    decode_steps: float
    finished: float
    bytes: int
    http_chunks: int
    gc_s: float      # the server's garbage collections, every generation
    gc_full: float   # its full (generation 2) collections
    gc_full_s: float

    def __sub__(self, o: Snapshot) -> Snapshot:
        return Snapshot(**{k: v - getattr(o, k) for k, v in asdict(self).items()})


class Clients:
    """N closed-loop streaming clients and what they received."""

    def __init__(self, session: aiohttp.ClientSession, url: str, tokens: int) -> None:
        self.session, self.url, self.tokens = session, url, tokens
        self.bytes = 0
        self.http_chunks = 0
        self.heard: set[int] = set()
        self.errors: list[str] = []
        self.sent = 0

    async def client(self, i: int) -> None:
        while True:
            body = {"model": "orpheus-tiny", "input": SENTENCES[self.sent % len(SENTENCES)], "voice": "tara",
                    "response_format": "pcm", "max_tokens": self.tokens, "ignore_eos": True}
            self.sent += 1
            try:
                async with self.session.post(f"{self.url}/v1/audio/speech", json=body) as r:
                    if r.status != 200:
                        self.errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        await asyncio.sleep(0.5)
                        continue
                    async for data, end in r.content.iter_chunks():
                        self.bytes += len(data)
                        self.http_chunks += end
                        if data:
                            self.heard.add(i)
            except aiohttp.ClientError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.5)


async def metrics(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(f"{url}/metrics") as r:
        return samples(await r.text())


async def snapshot(session: aiohttp.ClientSession, url: str, pid: int, clients: Clients,
                   counters: Counters) -> Snapshot:
    m = await metrics(session, url)
    cpu, main = cpu_seconds(pid)
    own, inside = os.times(), counters.read()
    # a token per llm row a step ran, and per new row a mixed step took in
    tokens = total(m, "mstar_batch_size_sum", component="llm") + total(m, "mstar_mixed_rows_total")
    return Snapshot(time.perf_counter(), cpu, main, own.user + own.system, inside["model"], inside["plan"], tokens,
                    total(m, "mstar_batch_size_sum", component="codec"),
                    total(m, "mstar_decode_steps_total"), total(m, "mstar_requests_total"),
                    clients.bytes, clients.http_chunks, total(m, "mstar_gc_pause_seconds_sum"),
                    total(m, "mstar_gc_pause_seconds_count", generation="2"),
                    total(m, "mstar_gc_pause_seconds_sum", generation="2"))


def py_spy(pid: int, prefix: str, streams: int, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy on the server for the window: GIL holders only, without pausing it; raw folded stacks
    (.svg / .json prefix suffixes are not added: the file is `<prefix>_<streams>.txt`)."""
    path = f"{prefix}_{streams}.txt"
    argv = ["py-spy", "record", "--pid", str(pid), "--gil", "--nonblocking", "--threads", "--format", "raw",
            "--duration", str(max(1, round(seconds))), "--output", path]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def run_level(session: aiohttp.ClientSession, url: str, pid: int, streams: int, a: argparse.Namespace,
                    counters: Counters) -> dict[str, Any]:
    clients = Clients(session, url, a.tokens)
    spy: subprocess.Popen[bytes] | None = None
    tasks = [asyncio.create_task(clients.client(i)) for i in range(streams)]
    try:
        ramp = time.perf_counter()
        while len(clients.heard) < streams:  # every stream speaking before the window opens
            if time.perf_counter() - ramp > a.ramp_timeout:
                raise SystemExit(f"{streams} streams: {len(clients.heard)} heard audio in {a.ramp_timeout:.0f} s; "
                                 f"errors: {clients.errors[:3]}")
            await asyncio.sleep(0.05)
        ramp_s = time.perf_counter() - ramp
        spy = py_spy(pid, a.py_spy, streams, a.seconds) if a.py_spy else None
        first = await snapshot(session, url, pid, clients, counters)
        await asyncio.sleep(a.seconds)
        d = await snapshot(session, url, pid, clients, counters) - first
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if spy is not None:
        _, err = spy.communicate()
        if spy.returncode:
            print(f"#   py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-300:]}", flush=True)
        else:
            print(f"#   py-spy: {a.py_spy}_{streams}.txt", flush=True)
    idle = time.perf_counter()
    while total(await metrics(session, url), "mstar_requests_running") > 0:  # the hung-up requests aborted
        if time.perf_counter() - idle > 60:
            raise SystemExit("the server still runs requests 60 s after its clients hung up")
        await asyncio.sleep(0.2)
    chunks, tokens = max(d.chunks, 1.0), max(d.tokens, 1.0)
    return {
        "streams": streams, "window_s": round(d.t, 2), "ramp_s": round(ramp_s, 2),
        "requests_done": int(d.finished), "errors": len(clients.errors),
        "chunks_per_s": d.chunks / d.t, "tokens_per_s": d.tokens / d.t,
        "audio_s_per_s": d.bytes / PCM_BYTES / SAMPLE_RATE / d.t,
        "http_chunks_per_s": d.http_chunks / d.t, "rows_per_decode_step": d.tokens / max(d.decode_steps, 1.0),
        "server_cores": d.cpu_s / d.t, "client_cores": d.client_cpu_s / d.t,
        "cpu_us_per_chunk": 1e6 * d.cpu_s / chunks, "cpu_us_per_token": 1e6 * d.cpu_s / tokens,
        "loop_us_per_chunk": 1e6 * d.main_cpu_s / chunks,
        "other_us_per_token": 1e6 * (d.cpu_s - d.main_cpu_s) / tokens,
        "model_us_per_token": 1e6 * d.model_s / tokens, "plan_us_per_token": 1e6 * d.plan_s / tokens,
        "gc_ms_per_s": 1e3 * d.gc_s / d.t, "gc_full": int(d.gc_full),
        "gc_full_ms": 1e3 * d.gc_full_s / max(d.gc_full, 1.0),
        "first_error": clients.errors[0] if clients.errors else None,
    }


COLUMNS = (  # (key, header, format)
    ("streams", "streams", "{:>7d}"), ("chunks_per_s", "chunk/s", "{:>8.0f}"), ("tokens_per_s", "tok/s", "{:>8.0f}"),
    ("audio_s_per_s", "audio s/s", "{:>9.2f}"), ("server_cores", "srv cores", "{:>9.2f}"),
    ("cpu_us_per_chunk", "us/chunk", "{:>8.1f}"), ("cpu_us_per_token", "us/tok", "{:>7.1f}"),
    ("loop_us_per_chunk", "loop us/chunk", "{:>13.1f}"), ("other_us_per_token", "other us/tok", "{:>12.1f}"),
    ("model_us_per_token", "model us/tok", "{:>12.1f}"), ("plan_us_per_token", "plan us/tok", "{:>11.1f}"),
    ("rows_per_decode_step", "rows/step", "{:>9.1f}"), ("gc_ms_per_s", "gc ms/s", "{:>7.1f}"),
    ("gc_full", "gc2", "{:>4d}"), ("gc_full_ms", "gc2 ms", "{:>6.1f}"), ("client_cores", "cli cores", "{:>9.2f}"),
    ("requests_done", "done", "{:>5d}"), ("errors", "err", "{:>4d}"),
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"python {platform.python_version()} | torch {version('torch')} | aiohttp {version('aiohttp')} | "
            f"uvloop {version('uvloop')} | cpu {cpu_model()} x{os.cpu_count()} | load avg {load} | "
            f"mstar {commit(REPO)}")


async def bench(a: argparse.Namespace, url: str, server: Server, counters: Counters) -> list[dict[str, Any]]:
    assert server.proc is not None
    # no connection cap (aiohttp's default is 100): one connection per stream
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await wait_healthy(url, a.startup_timeout, server)
        print("# " + environment(), flush=True)
        print(f"# orpheus-tiny with stand-ins, {a.tokens} tokens per request (ignore_eos), {a.seconds:.0f} s "
              f"windows, torch threads {a.torch_threads}; us = server CPU us (utime+stime); loop = its main "
              f"thread, other = the rest; model = what is left of the "
              f"model's compute (forward with stand-ins, sampler, SNAC window: a GPU's work); plan = attention "
              f"plans (torch backend)", flush=True)
        print(" ".join(h for _, h, _ in COLUMNS), flush=True)
        rows = []
        for streams in a.streams:
            row = await run_level(session, url, server.proc.pid, streams, a, counters)
            rows.append(row)
            print(" ".join(fmt.format(row[k]) for k, _, fmt in COLUMNS), flush=True)
            if row["first_error"]:
                print(f"#   first error: {row['first_error']}", flush=True)
        return rows


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[16, 64, 256], help="concurrent clients, per level")
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window of each level")
    p.add_argument("--tokens", type=int, default=1024, help="max_tokens of every request (ignore_eos)")
    p.add_argument("--torch-threads", type=int, default=1, help="the server's torch.set_num_threads")
    p.add_argument("--ramp-timeout", type=float, default=60.0, help="seconds for every stream to hear audio")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for /health")
    p.add_argument("--server-args", default="", help="more arguments for mstar.http, one string")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temp file)")
    p.add_argument("--py-spy", default=None, metavar="PREFIX",
                   help="record py-spy (--gil, raw folded stacks) of each window to PREFIX_<streams>.txt")
    p.add_argument("--out", type=Path, default=None, help="also write the rows and environment as JSON")
    p.add_argument("--default-gc", action="store_true",
                   help="the server keeps Python's garbage collection as it is (no `quiet_gc`: startup's objects "
                        "not frozen, the default thresholds)")
    a = p.parse_args()
    if min(a.streams) < 1 or a.tokens < 7 or a.seconds <= 0:
        p.error("--streams >= 1, --tokens >= 7 (a frame) and --seconds > 0")
    if a.py_spy and subprocess.run(["which", "py-spy"], capture_output=True).returncode:
        p.error("--py-spy: py-spy is not installed")
    return a


def main() -> None:
    a = parse()
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), SERVE, "--torch-threads", str(a.torch_threads),
            "--model", "orpheus-tiny", "--gpus", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(max(max(a.streams), 256)), "--log-level", "warning", *shlex.split(a.server_args)]
    log = a.server_log or Path(tempfile.mkstemp(prefix="bench_host_speech_", suffix=".log")[1])
    print(f"# server: {' '.join(argv[1:])} (log: {log})", flush=True)
    with tempfile.NamedTemporaryFile(prefix="bench_host_speech_", suffix=".counters") as f:
        f.write(bytes(8 * len(BUCKETS)))
        f.flush()
        os.environ[COUNTERS_ENV] = f.name  # the server's environment is this one's
        if a.default_gc:
            os.environ[DEFAULT_GC_ENV] = "1"
        counters = Counters(f.name)
        server = Server(argv, log)
        server.start()
        try:
            rows = run_async(bench(a, f"http://127.0.0.1:{port}", server, counters))
        finally:
            server.stop()
    hits = [line for line in server.tail(50).splitlines() if line.startswith("# stand-in calls: ")]
    print(hits[-1] if hits else f"# WARNING: the server did not report its stand-in calls (see {log})", flush=True)
    idle = [name for name, n in json.loads(hits[-1].split(": ", 1)[1]).items() if not n] if hits else []
    if idle:  # the code path moved past a patched function: the numbers include real compute, or the wrong one
        print(f"# WARNING: stand-ins that never ran: {', '.join(idle)}", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"environment": environment(), "args": {k: str(v) for k, v in vars(a).items()},
                                     "rows": rows}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == [SERVE]:
        sys.exit(serve(sys.argv[2:]))
    main()
