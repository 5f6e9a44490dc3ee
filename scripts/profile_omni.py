"""Where a Qwen3-Omni spoken answer's time goes: one or more `speak`
requests on the engine in this process, each component's steps timed on the
worker (synchronised, so the numbers are per step, not overlapped), by
component and mode: steps, rows, total and mean milliseconds.

On the H200 (from the repo root, PYTHONPATH=.):
    python scripts/profile_omni.py --concurrency 1 8
    python scripts/profile_omni.py --concurrency 32 --frames 125 --kernels 2
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar.config import EngineConfig, SchedulerConfig, graph_buckets  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.execution.runner import ComponentRunner  # noqa: E402
from mstar.engine.worker.executor import Executor  # noqa: E402
from mstar.types import GenerateRequest, SamplingParams  # noqa: E402
from scripts.bench_omni import question_messages  # noqa: E402

TIMES: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])  # steps, rows, seconds
TIMELINE: list[tuple[float, str, int, float]] = []  # start (s), component.mode, rows, ms
FIRSTS: dict[str, list[float]] = defaultdict(list)  # "text" / "audio" -> each request's first, s after start


def _timed(name: str, fn):
    def call(self, *args, **kwargs):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = fn(self, *args, **kwargs)
        sync()
        batch = args[0]
        if name == "group":
            key, rows = (batch.component, batch.mode), args[1].stop - args[1].start
        else:
            key, rows = (batch.component, batch.mode), len(batch.items)
        entry = TIMES[key]
        entry[0] += 1
        entry[1] += rows
        entry[2] += time.perf_counter() - t0
        TIMELINE.append((t0, f"{key[0]}.{key[1]}", rows, 1e3 * (time.perf_counter() - t0)))
        return out
    return call


async def _speak(eng: Engine, rid: str, model: str, text_tokens: int, frames: int, question: str = "text") -> None:
    request = GenerateRequest(rid, model, {"messages": question_messages(question)},
                              SamplingParams(max_tokens=text_tokens, ignore_eos=True), walk="speak",
                              sampling_by={"talker": {"max_tokens": frames + 1, "ignore_eos": True,
                                                      "stop_token_ids": []}})
    t0, seen = time.perf_counter(), set()
    async for chunk in eng.submit(request):
        for kind, got in (("text", chunk.token_ids), ("audio", chunk.audio)):
            if got and kind not in seen:
                seen.add(kind)
                FIRSTS[kind].append(time.perf_counter() - t0)
        if chunk.finished and chunk.error:
            raise RuntimeError(chunk.error)


async def _client(eng: Engine, name: str, args: argparse.Namespace) -> None:
    """One client's questions, each asked when the last is answered."""
    for k in range(args.requests_per_client):
        await _speak(eng, f"{name}-{k}", args.model, args.text_tokens, args.frames, args.question)


async def _kernels(eng: Engine, c: int, seconds: float, start: float, trace_dir: Path | None) -> None:
    """The worker's kernels over `seconds` from `start` seconds into the level."""
    await asyncio.sleep(start)
    prof = await eng.profile(seconds)
    print(f"\nconcurrency {c}: kernels over {seconds} s from {start} s into the level, by device time")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=70))
    print("by host time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"omni_c{c}.json"))


def _log_compiles() -> None:
    """Print every Triton compile (a kernel's first use at a new specialisation)
    with its time and duration: what a request would wait for after startup."""
    try:
        from triton import knobs
    except ImportError:
        return
    started: dict[str, float] = {}

    def before(*, key, repr, **_):
        started[str(key)] = time.perf_counter()
        return False

    def after(*, key, repr, **_):
        t0 = started.pop(str(key), time.perf_counter())
        print(f"triton compile {1e3 * (time.perf_counter() - t0):7.0f} ms at {time.perf_counter():.3f}: {repr[:160]}",
              flush=True)
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after


def _host_profile(skip: int, plans: int) -> cProfile.Profile:
    """cProfile of the worker thread over its plans skip .. skip + plans of
    each level (no synchronising timers: the host's own time, and its waits)."""
    prof, count, run = cProfile.Profile(), [0], Executor.run

    def profiled(self, plan):
        count[0] += 1
        if count[0] == skip:
            prof.enable()
        try:
            return run(self, plan)
        finally:
            if count[0] == skip + plans:
                prof.disable()
    Executor.run = profiled
    return prof


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-omni-30b-a3b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--text-tokens", type=int, default=40)
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--requests-per-client", type=int, default=1,
                   help="each client asks again when answered (closed loop, as bench_omni.py): above 1, the steps "
                        "of a steady state, where requests start while others speak")
    p.add_argument("--question", choices=("text", "audio"), default="text",
                   help="a typed question, or a 5 s clip through the audio encoder (as scripts/bench_omni.py asks)")
    p.add_argument("--timeline", action="store_true", help="print every step until each request has audio")
    p.add_argument("--kernels", type=float, default=0.0, metavar="SECONDS",
                   help="instead of timing steps: torch's profiler over SECONDS of each level (from --kernels-from) "
                        "and its kernels by device time and host time")
    p.add_argument("--kernels-from", type=float, default=1.0, metavar="SECONDS",
                   help="where --kernels starts: 1 s in (the default) is the steady state, 0 the level's first "
                        "prefills")
    p.add_argument("--trace-dir", type=Path, default=None, help="also write a Chrome trace per level here")
    p.add_argument("--host-profile", type=int, nargs=2, default=None, metavar=("SKIP", "PLANS"),
                   help="cProfile the worker thread over these plans of the last level instead of timing steps")
    args = p.parse_args()
    _log_compiles()
    prof = _host_profile(*args.host_profile) if args.host_profile else None
    if not args.kernels and prof is None:  # the timers synchronise every step, which the profiler would then show
        ComponentRunner.compute = _timed("items", ComponentRunner.compute)
        ComponentRunner.run_group = _timed("group", ComponentRunner.run_group)
    eng = Engine(EngineConfig(model=args.model, load_format="dummy", devices=(args.device,), max_model_len=4096,
                              scheduler=SchedulerConfig(max_num_seqs=64), cuda_graph_batch_sizes=graph_buckets(64)))
    await eng.start()
    try:
        await _speak(eng, "warm", args.model, 4, 4, args.question)
        if args.kernels:  # the profiler's first start stalls the worker for seconds (CUPTI's setup): not in a level
            await eng.profile(0.2)
        for c in args.concurrency:
            TIMES.clear()
            TIMELINE.clear()
            FIRSTS.clear()
            t0 = time.perf_counter()
            print(f"level {c} starts at {t0:.3f}", flush=True)
            runs = [_client(eng, f"p{c}-{i}", args) for i in range(c)]
            if args.kernels:
                runs.append(_kernels(eng, c, args.kernels, args.kernels_from, args.trace_dir))
            stats0 = dict(vars(eng.workers[0].stats))
            await asyncio.gather(*runs)
            wall = time.perf_counter() - t0
            stats = {k: v - stats0[k] for k, v in vars(eng.workers[0].stats).items()}
            print(f"worker: {stats['steps']} steps; decode groups' host time: waiting for the device "
                  f"{1e3 * stats['wait_s']:.0f} ms, launching {1e3 * stats['launch_s']:.0f} ms, reading "
                  f"{1e3 * stats['finalize_s']:.0f} ms")
            print(f"\nconcurrency {c}: {wall:.2f} s wall for {c} x {args.requests_per_client} x {args.frames} frames")
            print(f"{'component.mode':24} {'steps':>6} {'rows':>6} {'total ms':>10} {'ms/step':>8}")
            for (comp, mode), (steps, rows, secs) in sorted(TIMES.items(), key=lambda kv: -kv[1][2]):
                print(f"{comp + '.' + mode:24} {steps:6d} {rows:6d} {1e3 * secs:10.1f} {1e3 * secs / steps:8.2f}")
            for kind, times in FIRSTS.items():
                print(f"first {kind} (ms): " + " ".join(f"{1e3 * t:.0f}" for t in sorted(times)))
            if args.timeline:
                until = max(FIRSTS["audio"], default=0.0)
                print("steps until the last first audio (start ms, step, rows, ms):")
                for start, name, rows, ms in TIMELINE:
                    if start - t0 <= until:
                        print(f"  {1e3 * (start - t0):8.1f} {name:18} {rows:4d} {ms:7.2f}")
    finally:
        await eng.shutdown()
    if prof is not None:
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(40)
            print(out.getvalue())


if __name__ == "__main__":
    asyncio.run(main())
