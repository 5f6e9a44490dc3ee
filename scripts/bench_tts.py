"""Closed-loop TTS load benchmark: POST /v1/audio/speech over loopback HTTP.

Starts the server itself (`python -m mstar.http --model orpheus-3b
--load-format dummy --gpus 0 --port P`, its output in a log file), or targets
a running one with `--url`, and waits for /health. Then, after `--warmup`
requests that are not counted, for each `--concurrency` c: c aiohttp clients
in a closed loop, each sending `POST /v1/audio/speech` with a short fixed
sentence, `response_format: "pcm"`, `ignore_eos: true` and `max_tokens:
--audio-tokens`, streaming the body and timing every HTTP chunk. A level
ends after `--requests-per-client` rounds or once `--seconds` have passed
(no client starts a request after that; the ones in flight finish, each
bounded by `--timeout`), so every run stops by itself. The server is stopped
(SIGTERM, then killed) before the baseline and on any exit.

Per request: TTFA (send -> first audio byte), the chunks' arrival times and
sizes (PCM16 mono -> seconds of audio), RTF (first -> last byte over the
audio's duration; also over the whole request) and stalls (see
tts_report.py). Per level: TTFA p50/p99, RTF p50, SV (share of all chunks on
time), audio seconds per wall second, and the server's own mean first-audio
time (submit -> first chunk, from its /metrics around the level: what of a
client's TTFA the server spent, the rest being the client's send, HTTP and
the wait before the submit); and max_realtime_streams, the largest
concurrency with SV >= 0.99, TTFA p99 <= 1 s and no failed request.

Baseline (unless `--skip-baseline`), after the server is gone: transformers
`generate` on the same shapes (LlamaForCausalLM of the model's config,
random weights, bf16 on a GPU, Orpheus's sampling, exactly `--audio-tokens`
new tokens) and the snac package's 24 kHz decoder (random weights) over the
whole utterance, at each `--baseline-batches`: audio s/s = batch x
(audio_tokens // 7 x 2048 / 24000) / wall time.

Writes `--out` (JSON: gpu, rows, max_realtime_streams, baseline) and a
markdown table beside it (.md) with the environment and M*'s reference
numbers; both are rewritten after every level, so a run stopped by a
`timeout` keeps the levels it finished.

On the H200, from the repo root (PYTHONPATH=. where mstar is not
pip-installed; the server subprocess gets the repo root on its path anyway):
    python scripts/bench_tts.py --out docs/benchmarks/tts.json
Against a server already running:
    python scripts/bench_tts.py --url http://127.0.0.1:8000 --skip-baseline --out /tmp/tts.json
A CPU smoke test (its numbers do not belong in docs/benchmarks):
    python scripts/bench_tts.py --model orpheus-tiny --gpus cpu --concurrency 1 2 --audio-tokens 70 \\
        --requests-per-client 1 --skip-baseline --out /tmp/tts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

# sibling modules: the script's folder is first on sys.path
from bench_server import REPO, Server, add_server_args, on_sigterm, run_async, start_server, wait_healthy
from tts_report import (Level, Stream, environment, expected_audio_s, first_audio_totals, level_extras, level_row,
                        max_realtime_streams, write_markdown)

# Tens of words each: long enough to be a real utterance's prompt, short
# enough that prefill is a small part of a request next to 1024 decode steps.
SENTENCES = (
    ("The morning train was late again, so I bought a coffee and watched the pigeons argue over a crust of bread "
     "on the platform."),
    ("Please remember to water the tomatoes while I am away, and check that the back gate is closed before it gets "
     "dark."),
    ("Our quarterly numbers look better than expected, mostly because the new warehouse finally started shipping "
     "orders on time."),
    ("If you follow the river path for about two miles, you will reach an old stone bridge with a small cafe on the "
     "other side."),
    "The museum opens at ten on weekdays, but the guided tour of the east wing only runs on Saturday afternoons.",
    "I tried to fix the kitchen tap myself, and now there is a puddle under the sink and a very confused cat.",
    ("Thank you for calling; all of our agents are busy right now, so please stay on the line and we will be with "
     "you shortly."),
    ("She read the letter twice, folded it carefully along the old creases, and put it back in the drawer without "
     "a word."),
)

RETRY_CAP_S = 5.0  # the longest a refused request waits before it is sent again


def speech_body(a: argparse.Namespace, model: str, n: int) -> dict[str, Any]:
    """The n-th request's body: every one asks for the same number of tokens
    so requests are alike; the sentence only varies the (short) prompt."""
    body: dict[str, Any] = {"model": model, "input": SENTENCES[n % len(SENTENCES)], "voice": a.voice,
                            "response_format": "pcm", "max_tokens": a.audio_tokens, "ignore_eos": True}
    if a.seed is not None:
        body["seed"] = a.seed + n
    if a.early_audio:
        body["early_audio"] = True
    return body


async def speak(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float,
                stream: Stream | None = None) -> Stream:
    """One streamed request; never raises for the request's own failures
    (they land in `Stream.error`). Into `stream` when given, chunk by chunk as
    they come, so a request cancelled midway keeps what it heard."""
    stream = stream or Stream(sent=time.perf_counter())
    try:
        while True:  # a refusal (429/503) carries Retry-After: wait, then send again
            r = await session.post(f"{url}/v1/audio/speech", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s))
            retry = r.headers.get("Retry-After", "")
            if r.status not in (429, 503) or not retry.isdigit():
                break
            stream.refusals += 1
            r.release()
            if time.perf_counter() + float(retry) - stream.sent > timeout_s:
                stream.error = f"refused {stream.refusals} times until --timeout"
                return stream
            await asyncio.sleep(min(float(retry), RETRY_CAP_S))
        async with r:
            if r.status != 200:
                stream.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return stream
            stream.sample_rate = int(r.headers.get("X-Sample-Rate", stream.sample_rate))
            pending = 0
            # iter_chunks marks the end of each HTTP chunk: one server write,
            # one window of audio, whatever pieces TCP delivered it in
            async for data, end_of_chunk in r.content.iter_chunks():
                now = time.perf_counter()
                if data and stream.first_byte is None:
                    stream.first_byte = now
                pending += len(data)
                if end_of_chunk and pending:
                    stream.add(now, pending)
                    pending = 0
            if pending:
                stream.add(time.perf_counter(), pending)
    except (aiohttp.ClientError, TimeoutError) as e:
        # a body cut short (the server failed mid-stream), a refused
        # connection, or the request running past --timeout
        stream.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        stream.end = time.perf_counter()
    return stream


async def run_level(session: aiohttp.ClientSession, url: str, model: str, concurrency: int,
                    a: argparse.Namespace, first_index: int) -> Level:
    """`concurrency` clients, each sending its next request as soon as its
    last one ended, for the rounds or seconds of `a`."""
    streams: list[Stream] = []
    before = await server_first_audio(session, url)
    start = time.perf_counter()

    async def client(i: int) -> None:
        for rnd in range(a.requests_per_client):
            if time.perf_counter() - start >= a.seconds:
                break
            n = first_index + rnd * concurrency + i
            streams.append(await speak(session, url, speech_body(a, model, n), a.timeout))

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    after = await server_first_audio(session, url)
    spent = (after[0] - before[0], after[1] - before[1]) if before and after else None
    return Level(concurrency, streams, wall, spent)


async def server_first_audio(session: aiohttp.ClientSession, url: str) -> tuple[float, float] | None:
    """The server's first-audio histogram's sum and count from /metrics
    (None: no such metric, or /metrics did not answer)."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return first_audio_totals(text)


class Results:
    """What the run measured so far, written to `--out` and its .md after
    every level, so a run stopped midway (a `timeout` around it) still
    leaves the levels it finished."""

    def __init__(self, a: argparse.Namespace, server_desc: str) -> None:
        self.a = a
        self.server_desc = server_desc
        self.env: dict[str, str] = {}
        self.levels: list[Level] = []
        self.baseline: list[dict[str, Any]] = []

    def set_environment(self, health: dict[str, Any]) -> None:
        """The environment from the server's /health (its devices and model)
        and the run's settings."""
        a = self.a
        devices = [str(d.get("device")) for d in health.get("devices", [])] or [
            f"cuda:{g}" if g.isdigit() else g for g in a.gpus.split(",")]
        model = str(health.get("model") or a.model)
        if not a.url:
            model += f" ({a.load_format} weights)"
        words = [len(s.split()) for s in SENTENCES]
        settings = {
            "audio tokens per request": f"{a.audio_tokens} (max_tokens, ignore_eos; "
                                        f"{expected_audio_s(a.audio_tokens):.2f} s of audio if all are audio tokens)",
            "levels": f"concurrency {' '.join(map(str, a.concurrency))}; {a.requests_per_client} requests per client "
                      f"or {a.seconds:.0f} s, whichever first; {a.warmup} warm-up request(s) not counted",
            "requests": f"response_format pcm, voice {a.voice}, {len(SENTENCES)} fixed sentences of "
                        f"{min(words)}-{max(words)} words, the model's default sampling"
                        + (f", seed {a.seed} + index" if a.seed is not None else "")
                        + (", early_audio (the first frame from a 2-frame window)" if a.early_audio else ""),
        }
        self.env = environment(devices, model, self.server_desc, REPO, settings)
        print("# " + " | ".join(f"{k} {v}" for k, v in self.env.items()), flush=True)

    def write(self) -> dict[str, Any]:
        """The JSON (exactly the schema's keys) and the markdown; the JSON."""
        rows, extras, failed = [], {}, {}
        for level in self.levels:
            row = level_row(level)
            if level.errors:
                failed[level.concurrency] = level.errors
            if row is not None:
                rows.append(row)
                extras[level.concurrency] = level_extras(level)
        result = {"gpu": self.env.get("gpu", "unknown"), "rows": rows,
                  "max_realtime_streams": max_realtime_streams(rows, extras), "baseline": self.baseline}
        out = self.a.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_markdown(out.with_suffix(".md"), result, extras, self.env, failed, self.a.audio_tokens)
        return result


async def run_levels(a: argparse.Namespace, url: str, server: Server | None, results: Results) -> None:
    """Health, warm-up, then every level, each written out as it ends."""
    t0 = time.perf_counter()
    health = await wait_healthy(url, a.startup_timeout, server)
    print(f"# server healthy after {time.perf_counter() - t0:.1f} s: model {health.get('model')}, devices "
          f"{[d.get('device') for d in health.get('devices', [])]}", flush=True)
    results.set_environment(health)
    model = health.get("model") or a.model
    # limit=0: one connection per client, or aiohttp's default pool of 100
    # would queue the clients of the larger levels inside the client itself
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(a.warmup):
            # first requests pay for lazy initialisation (allocators, kernels)
            # that no later request sees
            t = time.perf_counter()
            s = await speak(session, url, speech_body(a, model, i), a.timeout)
            state = f"{s.audio_s:.2f} s of audio" if s.ok else f"failed: {s.error}"
            print(f"# warm-up request {i + 1}: {time.perf_counter() - t:.1f} s, {state}", flush=True)
        print(f"{'conc':>5} {'reqs':>5} {'errs':>5} {'refd':>5} {'ttfa p50':>9} {'ttfa p99':>9} {'rtf p50':>8} "
              f"{'rtf tot':>8} {'sv':>6} {'audio/s':>8} {'audio/req':>9} {'wall s':>7} {'srv ttfa':>9}", flush=True)
        n = a.warmup
        for c in a.concurrency:
            if server is not None and server.exited() is not None:
                print(f"# server exited with status {server.exited()}; stopping:\n{server.tail()}", flush=True)
                break
            level = await run_level(session, url, model, c, a, n)
            n += len(level.streams)
            print_level(level)
            results.levels.append(level)
            results.write()


def print_level(level: Level) -> None:
    row, x = level_row(level), level_extras(level)
    if row is None:
        print(f"{level.concurrency:>5} {x['requests']:>5} {x['errors']:>5}  no request produced audio: "
              f"{level.errors[0] if level.errors else ''}", flush=True)
        return
    print(f"{level.concurrency:>5} {x['requests']:>5} {x['errors']:>5} {x['refused']:>5} {row['ttfa_p50_ms']:>7.0f}ms "
          f"{row['ttfa_p99_ms']:>7.0f}ms {row['rtf_p50']:>8.3f} {x['rtf_total_p50']:>8.3f} {row['sv']:>6.3f} "
          f"{row['audio_s_per_s']:>8.2f} {x['audio_s_per_request']:>8.2f}s {x['wall_s']:>7.1f} "
          f"{x['server_ttfa_mean_ms']:>7.0f}ms", flush=True)
    if x["errors"]:
        print(f"#   first error: {level.errors[0]}", flush=True)


# -- baseline

def baseline(a: argparse.Namespace) -> list[dict[str, Any]]:
    """transformers `generate` + snac decode at each baseline batch (see the
    module doc); one row per batch."""
    import snac
    import torch
    from decode_measures import build_hf  # sibling module

    from mstar.config import parse_devices
    from mstar.models.orpheus.tokens import LEVEL_POSITIONS
    from mstar.models.registry import load_model
    from mstar.models.snac import SNAC_24KHZ
    from mstar.types import GenerateRequest

    device = torch.device(parse_devices(a.gpus)[0])
    model = load_model(a.model, a.load_format, None)
    dtype = model.default_dtype(device)  # bf16 on a GPU, as the server runs its LLM
    sp = model.default_sampling()
    # the same prompt as the first benchmark request, through the model's own prompt format
    prompt = model.prepare(GenerateRequest("baseline", a.model, {"text": SENTENCES[0], "voice": a.voice}, sp))
    prompt_ids = torch.as_tensor(prompt.values["prompt_ids"]).view(1, -1)
    hf = build_hf(model.config, device, dtype)
    # float32: the snac package's own precision, as the server's codec runs
    codec = snac.SNAC(**SNAC_24KHZ.to_dict()).eval().to(device)
    frame = sum(len(p) for p in LEVEL_POSITIONS)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def speak_batch(batch: int, new_tokens: int) -> float:
        ids = prompt_ids.repeat(batch, 1).to(device)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=sp.temperature, top_p=sp.top_p,
                          repetition_penalty=sp.repetition_penalty, pad_token_id=0)
        tokens = out[:, ids.shape[1]:]
        assert tokens.shape == (batch, new_tokens), tokens.shape
        frames = new_tokens // frame
        # random weights write any id: fold them into codes the way Orpheus's
        # decoder splits a 7-token frame across SNAC's three levels
        grid = (tokens[:, :frames * frame] % SNAC_24KHZ.codebook_size).view(batch, frames, frame)
        codes = [grid[:, :, list(pos)].reshape(batch, -1) for pos in LEVEL_POSITIONS]
        audio = codec.decode(codes)
        sync()
        wall = time.perf_counter() - t0
        assert audio.shape[-1] == frames * SNAC_24KHZ.samples_per_coarse_frame, audio.shape
        return wall

    rows = []
    audio_s = expected_audio_s(a.audio_tokens, SNAC_24KHZ.sampling_rate)
    for batch in a.baseline_batches:
        speak_batch(batch, 4 * frame)  # warm-up: kernels, allocator, the codec's first shapes
        wall = statistics.median(speak_batch(batch, a.audio_tokens) for _ in range(a.baseline_repeats))
        rate = batch * audio_s / wall
        rows.append({"name": "transformers generate + snac decode", "batch": batch, "audio_s_per_s": round(rate, 2)})
        print(f"# baseline batch {batch}: {wall:.1f} s for {batch} x {audio_s:.2f} s of audio -> {rate:.2f} audio s/s",
              flush=True)
    return rows


# -- the run

def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b", help="the server's --model (and the baseline's config)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--gpus", default="0", help="the server's --gpus (cpu | 0 | 0,1); the baseline uses the first")
    add_server_args(p, startup_timeout=900.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--audio-tokens", type=int, default=1024, help="max_tokens of every request (ignore_eos)")
    p.add_argument("--requests-per-client", type=int, default=2, help="rounds per level at most")
    p.add_argument("--seconds", type=float, default=60.0, help="no request starts this long into a level")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before the first level")
    p.add_argument("--voice", default="tara")
    p.add_argument("--seed", type=int, default=None, help="send seed + request index (default: none sent)")
    p.add_argument("--early-audio", action="store_true",
                   help="ask for the early walk (`early_audio`): first audio after 2 frames of tokens, not 4")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--baseline-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--baseline-repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks/tts.json"))
    a = p.parse_args()
    for name in ("audio_tokens", "requests_per_client", "baseline_repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(a.concurrency) < 1 or min(a.baseline_batches) < 1 or a.audio_tokens < 7:
        p.error("concurrencies and batches must be at least 1, --audio-tokens at least 7 (one frame of audio)")
    return a


def main() -> None:
    a = parse()
    signal.signal(signal.SIGTERM, on_sigterm)
    url, server, server_desc = start_server(
        a, ["--model", a.model, "--load-format", a.load_format, "--gpus", a.gpus], "bench_tts_server_")
    results = Results(a, server_desc)
    try:
        run_async(run_levels(a, url, server, results))
    finally:
        if server is not None:
            server.stop()  # before the baseline: it needs the GPU memory the server holds
    result = results.write()
    print(f"# max_realtime_streams {result['max_realtime_streams']}", flush=True)
    if not a.skip_baseline:
        results.baseline = baseline(a)
        results.write()
    print(f"# wrote {a.out} and {a.out.with_suffix('.md')}", file=sys.stderr)
    if not result["rows"]:
        raise SystemExit("no level produced audio")

if __name__ == "__main__":
    main()
