"""Qwen3-Omni spoken-answer benchmark: closed-loop spoken chats at each
`--concurrency`, over HTTP (`--transport http`, the default: streamed
`/v1/chat/completions` with `modalities: ["text", "audio"]` and pcm16 audio
deltas, against a server this script starts, or `--url`) or on the engine in
this process (`--transport engine`: the runtime's own latency).

Two kinds of question (`--question`): `text` (a short typed question) and
`audio` (a 5 s clip, through the audio encoder). Every answer is
`--text-tokens` thinker tokens and `--frames` talker frames (EOS ignored on
both, so a dummy checkpoint's answers are as long as a real one's), the talker
reading the text token by token as the thinker writes it, code2wav streaming
each frame.

Per request: time to the first text token (TTFT; over HTTP the first
non-empty transcript piece, which a dummy checkpoint's random tokens may
never give) and to the first audio byte (TTFA) from submission, the audio's seconds, and RTF = (last audio byte -
first audio byte) / audio seconds after the first (below 1: faster than real
time). Per level: TTFT and TTFA p50/p90, RTF p50, and audio seconds per wall
second over the level.

On the H200 (from the repo root, PYTHONPATH=.):
    python scripts/bench_omni.py --out docs/benchmarks/omni.json
A CPU smoke run (its numbers do not belong in docs/benchmarks):
    python scripts/bench_omni.py --model qwen3-omni-tiny --device cpu --concurrency 1 2 --text-tokens 6 \\
        --frames 8 --requests-per-client 1 --out /tmp/omni.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench_env import REPO, commit, version
from bench_server import add_server_args, on_sigterm, start_server, wait_healthy

sys.path.insert(0, str(REPO))

from mstar.config import EngineConfig, SchedulerConfig, graph_buckets  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402

SAMPLE_RATE = 24000
QUESTION = "In one short paragraph, what makes a good cup of coffee?"
PEERS = ("vLLM-Omni: TTFP 523 ms at c=1 (H800); 632 ms mean at c=64 on 3 GPUs, RTF 0.47. "
         "M*: about 12 audio-s/s at batch 1 and 114 at batch 32 on two H200s.")


@dataclass
class Sample:
    ttft_s: float
    ttfa_s: float
    audio_s: float
    rtf: float
    wall_s: float


@dataclass
class Level:
    concurrency: int
    question: str
    requests: int = 0
    failed: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    ttfa_p50_ms: float = 0.0
    ttfa_p90_ms: float = 0.0
    rtf_p50: float = 0.0
    audio_s_per_s: float = 0.0
    samples: list[Sample] = field(default_factory=list, repr=False)


def _clip(seconds: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * 330 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def question_messages(question: str) -> list[dict]:
    """The chat messages of a `text` or `audio` question, as the engine takes them."""
    if question == "audio":
        return [{"role": "user", "content": [{"type": "audio", "audio": _clip(5.0)},
                                             {"type": "text", "text": "Answer the question in the clip."}]}]
    return [{"role": "user", "content": QUESTION}]


def _wav_b64(clip: np.ndarray) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, clip, 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def _chat_body(args: argparse.Namespace, question: str) -> dict:
    if question == "audio":
        content: str | list = [{"type": "input_audio", "input_audio": {"data": _wav_b64(_clip(5.0)), "format": "wav"}},
                               {"type": "text", "text": "Answer the question in the clip."}]
    else:
        content = QUESTION
    return {"model": args.model, "messages": [{"role": "user", "content": content}], "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "max_tokens": args.text_tokens, "temperature": 0.7, "top_p": 0.8, "ignore_eos": True,
            "sampling_by": {"talker": {"max_tokens": args.frames + 1, "ignore_eos": True, "stop_token_ids": []}}}


async def _one_http(session, url: str, args: argparse.Namespace, question: str) -> Sample:
    t0 = time.perf_counter()
    ttft = ttfa = last = None
    samples = 0
    async with session.post(f"{url}/v1/chat/completions", json=_chat_body(args, question)) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices", ()):
                delta, now = choice.get("delta") or {}, time.perf_counter() - t0
                audio = delta.get("audio") or {}
                if ttft is None and (audio.get("transcript") or delta.get("content")):
                    ttft = now
                if audio.get("data"):
                    ttfa = now if ttfa is None else ttfa
                    last = now
                    samples += len(base64.b64decode(audio["data"])) // 2
    if ttfa is None or last is None:
        raise RuntimeError("no audio came back")
    return _sample(ttft if ttft is not None else float("nan"), ttfa, last, samples, time.perf_counter() - t0)


def _sample(ttft: float, ttfa: float, last: float, samples: int, wall: float) -> Sample:
    audio_s = samples / SAMPLE_RATE
    first_chunk_s = (1920 - 555) / SAMPLE_RATE  # what the first frame plays
    return Sample(ttft, ttfa, audio_s, (last - ttfa) / max(audio_s - first_chunk_s, 1e-9), wall)


async def _one(eng: Engine, rid: str, model: str, args: argparse.Namespace, question: str) -> Sample:
    request = GenerateRequest(
        rid, model, {"messages": question_messages(question), "voice": "ethan"},
        SamplingParams(max_tokens=args.text_tokens, temperature=0.7, top_p=0.8, ignore_eos=True), walk="speak",
        sampling_by={"talker": {"max_tokens": args.frames + 1, "ignore_eos": True, "stop_token_ids": []}})
    t0 = time.perf_counter()
    ttft = ttfa = last = None
    samples = 0
    async for chunk in eng.submit(request):
        now = time.perf_counter()
        if chunk.token_ids and ttft is None:
            ttft = now - t0
        if chunk.audio:
            ttfa = now - t0 if ttfa is None else ttfa
            last = now - t0
            samples += len(chunk.audio) // 2
        if chunk.finished and chunk.error is not None:
            raise RuntimeError(chunk.error)
    if ttft is None or ttfa is None or last is None:
        raise RuntimeError("no text or no audio came back")
    return _sample(ttft, ttfa, last, samples, time.perf_counter() - t0)


async def _level(one, args: argparse.Namespace, c: int, question: str) -> Level:
    """`one(rid, question)`: a request's sample, by either transport."""
    level = Level(c, question)
    t0 = time.perf_counter()

    async def client(k: int) -> None:
        for r in range(args.requests_per_client):
            try:
                level.samples.append(await one(f"{question}-{c}-{k}-{r}", question))
            except Exception as e:  # noqa: BLE001 - a failed request is counted, the level goes on
                level.failed += 1
                print(f"request failed: {e}", file=sys.stderr)

    await asyncio.gather(*(client(k) for k in range(c)))
    wall = time.perf_counter() - t0
    s = level.samples
    level.requests = len(s)
    if s:
        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q))
        texts = [x.ttft_s for x in s if x.ttft_s == x.ttft_s] or [float("nan")]  # NaN: no text came
        level.ttft_p50_ms, level.ttft_p90_ms = (1e3 * pct(texts, q) for q in (50, 90))
        level.ttfa_p50_ms, level.ttfa_p90_ms = (1e3 * pct([x.ttfa_s for x in s], q) for q in (50, 90))
        level.rtf_p50 = statistics.median(x.rtf for x in s)
        level.audio_s_per_s = sum(x.audio_s for x in s) / wall
    return level


def _markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Qwen3-Omni spoken answers ({result['model']}, {result['load_format']} weights)", "",
             f"Commit {env['commit']}; {env['device']}; torch {env['torch']}, triton {env['triton']}, "
             f"flashinfer {env['flashinfer']}. Each answer: {result['text_tokens']} text tokens and "
             f"{result['frames']} frames ({result['frames'] * 0.08:.1f} s of audio); "
             f"{'over HTTP (streamed chat completions)' if result['transport'] == 'http' else 'engine in process'}, "
             "closed loop.", "",
             "| question | concurrency | requests | TTFT p50 / p90 (ms) | first audio p50 / p90 (ms) | RTF p50 | "
             "audio s/s |", "|---|---|---|---|---|---|---|"]
    for r in result["levels"]:
        lines.append(f"| {r['question']} | {r['concurrency']} | {r['requests']} (failed {r['failed']}) | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | {r['ttfa_p50_ms']:.0f} / "
                     f"{r['ttfa_p90_ms']:.0f} | {r['rtf_p50']:.2f} | {r['audio_s_per_s']:.1f} |")
    lines += ["", f"Published peers: {PEERS}", "", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


async def _run(args: argparse.Namespace, one, result: dict) -> None:
    # compile and warm every path (the audio encoder's too); with --warm-rows N at N rows at once, so what is
    # built on first use at a batch size lands here, and the warm-up's first audio shows what that cost
    result["warmup"] = []
    for question in args.question:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(f"warmup-{question}-{k}", question) for k in range(args.warm_rows)))
        result["warmup"].append({"question": question, "rows": args.warm_rows,
                                 "ttfa_max_ms": 1e3 * max(x.ttfa_s for x in got),
                                 "wall_s": time.perf_counter() - t0})
        print(json.dumps(result["warmup"][-1]), flush=True)
    for question in args.question:
        for c in args.concurrency:
            level = await _level(one, args, c, question)
            row = {k: v for k, v in asdict(level).items() if k != "samples"}
            result["levels"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(result, indent=1))
            args.out.with_suffix(".md").write_text(_markdown(result))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", choices=["http", "engine"], default="http")
    p.add_argument("--model", default="qwen3-omni-30b-a3b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--question", nargs="+", default=["text", "audio"], choices=["text", "audio"])
    p.add_argument("--text-tokens", type=int, default=60)
    p.add_argument("--frames", type=int, default=125)  # 10 s of speech
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--warm-rows", type=int, default=1,
                   help="concurrent warm-up requests per question (first-use costs at that batch size land there)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--cuda-graph-max-batch", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    add_server_args(p, startup_timeout=600)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)

    import torch

    result = {
        "model": args.model, "load_format": args.load_format, "text_tokens": args.text_tokens,
        "frames": args.frames, "transport": args.transport, "command": " ".join(sys.argv), "levels": [],
        "environment": {"commit": commit(REPO), "torch": torch.__version__, "triton": version("triton"),
                        "flashinfer": version("flashinfer-python", "flashinfer"),
                        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"},
    }
    if args.transport == "engine":
        config = EngineConfig(model=args.model, load_format=args.load_format, devices=(args.device,),
                              max_model_len=4096, scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
                              cuda_graph_batch_sizes=graph_buckets(args.cuda_graph_max_batch))
        eng = Engine(config)
        await eng.start()
        try:
            await _run(args, lambda rid, q: _one(eng, rid, args.model, args, q), result)
        finally:
            await eng.shutdown()
        return
    import aiohttp

    gpus = args.device.split(":", 1)[1] if args.device.startswith("cuda:") else args.device
    serve = ["--model", args.model, "--load-format", args.load_format, "--gpus", gpus, "--max-model-len", "4096",
             "--max-num-seqs", str(args.max_num_seqs), "--cuda-graph-max-batch", str(args.cuda_graph_max_batch)]
    url, server, desc = start_server(args, serve, "omni-server-")
    result["server"] = desc
    try:
        await wait_healthy(url, args.startup_timeout, server)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            await _run(args, lambda rid, q: _one_http(session, url, args, q), result)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
