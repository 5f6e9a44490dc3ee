"""Where a speech step's time goes: the engine in-process, no HTTP.

Runs `--model` (default orpheus-3b, dummy weights) on one device with c
concurrent `speak` requests (the model's default sampling, `ignore_eos`,
`--tokens` new tokens each) and prints, per level: wall time, audio seconds
per wall second, the share of sampled tokens that were audio ids, and per
(component, mode): steps, mean rows, mean step and device milliseconds, and
the share of the worker's time, and the first audio of the level's first
requests (and of `--arrivals`) in parts: waiting for the first code, the
decode steps to the first window's last code, the window (`first_audio_parts.py`). With `--trace S`, S seconds of torch
profiler in each level (from `--trace-after` seconds in) print the worker's phases
(the `mstar.*` ranges: CPU time and the device time of what they launched)
and the top CUDA kernels. A short warm-up level runs first, uncounted. Each
level prints what it may have paid once (`level_costs.py`: pinned and device
blocks allocated, garbage collections): `--concurrency 64 64` compares a
first burst with the same burst again; `--quiet-gc` sets Python's collector
as the server does.

    python scripts/profile_tts.py --concurrency 1 64 256 --tokens 512
    python scripts/profile_tts.py --model orpheus-tiny --devices cpu --concurrency 2 --tokens 70
    python scripts/profile_tts.py --concurrency 64 --tokens 1200 --trace 2 --arrivals 0.1 [--cprofile 40]
    python scripts/profile_tts.py --model orpheus-tiny --devices cpu --stub-compute --concurrency 400 --tokens 120
    python scripts/profile_tts.py --model orpheus-tiny --devices cpu --stub-compute --concurrency 256 \
        --tokens 700 --host-cpu

`--stub-compute` puts `bench_host_speech.py`'s stand-ins in place of the
model's heavy compute (LM head, sampler, attention, SNAC window): what is
left of a step's time on the CPU is the host's work for it. `--host-cpu`
prints the worker thread's CPU time in item steps per row (a codec's
windows, their routing and the walk's bookkeeping) and in feeding a decode
group's tokens into their streams per token (cutting windows included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import platform
import pstats
import time
from collections import defaultdict
from typing import Callable

import torch

from mstar.config import EngineConfig, SchedulerConfig, graph_buckets, scheduler_steps
from mstar.errors import ConfigError
from mstar.engine.engine import Engine
from mstar.engine.worker.executor import Executor
from mstar.engine.messages import StepReport
from mstar.http import __main__ as http_main
from mstar.types import GenerateRequest

import worker_profile  # this script's folder is on the path
from first_audio_parts import FirstAudioParts
from level_costs import LevelCosts

CPROFILE_ROWS = 0  # --cprofile: Python profiler rows to print (0: torch profiler)
TRACE_CPU_ROWS = 0  # --trace-cpu: ops by host time to print beside the kernels
UNTRACED_ARRIVALS_S = 3.0  # --arrivals without --trace: arrivals for this long after the first second's
TEXT = "The morning train was late again, so I bought a coffee and watched the pigeons argue over a crust of bread."


async def level(eng: Engine, c: int, tokens: int, trace_s: float, trace_after: float, every: float = 0.0,
                arrival_tokens: int = 140) -> dict:
    by_step: dict[tuple[str, str], list[StepReport]] = defaultdict(list)
    hook = eng.add_report_hook(lambda r: by_step[(r.component, r.mode)].append(r) if r.component else None)
    parts = FirstAudioParts()  # the level's first requests' and the arrivals' ways to their first audio
    parts_hook = eng.add_report_hook(parts.on_report)
    sampling = dataclasses.replace(eng.model.default_sampling(), max_tokens=tokens, ignore_eos=True)
    audio_bytes = 0
    sampled = 0
    first_audio: list[float] = []

    arrivals_over = asyncio.Event()

    async def one(i: int) -> None:
        """Client i's stream; with arrivals, streams again until the arrivals' window is over, so the window
        measures arrivals beside c running streams (however short `--tokens` is)."""
        nonlocal audio_bytes, sampled
        turn = 0
        while turn == 0 or (every > 0 and not arrivals_over.is_set()):
            t0 = time.perf_counter()
            params = dataclasses.replace(sampling, seed=i + turn * c)
            if turn == 1:  # the c streams started together: their second turns end spread over a turn's length
                params = dataclasses.replace(params, max_tokens=max(1, tokens * (i + 1) // c))
            req = GenerateRequest(f"p{c}-{i}-{turn}", eng.model_name, {"text": TEXT, "voice": None}, params)
            heard = turn > 0  # the first audio of the level's first requests only
            if not heard:
                parts.submitted(req.request_id)
            async for out in eng.submit(req):
                if out.audio:
                    if not heard:
                        heard = True
                        first_audio.append(time.perf_counter() - t0)
                        parts.heard(req.request_id)
                    audio_bytes += len(out.audio)
                if out.finished:
                    sampled += out.num_output_tokens
            turn += 1

    HOST_CPU.clear()
    costs = LevelCosts.start()
    worker = eng.workers[0]
    stats0, cpu0 = dataclasses.replace(worker.stats), worker.cpu_s()
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(c)]
    prof = arrivals_prof = None
    if trace_s > 0:
        await asyncio.sleep(trace_after)
        prof = await _window(eng, trace_s)
    elif every > 0:  # the level's first requests' first audio comes alone, before any arrival
        await asyncio.sleep(trace_after)
    if every > 0:  # then new short requests every `every` s, traced as long again
        arrivals: list[asyncio.Task] = []

        async def arrive() -> None:
            while True:
                short = dataclasses.replace(sampling, max_tokens=arrival_tokens, seed=len(arrivals))
                req = GenerateRequest(f"a{c}-{len(arrivals)}", eng.model_name, {"text": TEXT, "voice": None}, short)
                parts.submitted(req.request_id)
                arrivals.append(asyncio.create_task(_drain(eng, req, parts)))
                await asyncio.sleep(every)
        feeder = asyncio.create_task(arrive())
        await asyncio.sleep(1.0)
        if trace_s > 0:
            arrivals_prof = await _window(eng, trace_s)
        else:  # untraced: the arrivals' ways to their first audio as served, without the profiler's slowdown
            await asyncio.sleep(UNTRACED_ARRIVALS_S)
        feeder.cancel()
        arrivals_over.set()
        await asyncio.gather(*arrivals)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    costs.stop()
    st = worker.stats
    phases = {name: getattr(st, name) - getattr(stats0, name) for name in ("wait_s", "launch_s", "finalize_s")}
    phases["cpu_s"] = worker.cpu_s() - cpu0
    eng.remove_report_hook(hook)
    eng.remove_report_hook(parts_hook)
    return {"c": c, "wall": wall, "audio_s": audio_bytes / 2 / 24_000, "sampled": sampled, "steps": dict(by_step),
            "first_audio": sorted(first_audio), "prof": prof, "arrivals_prof": arrivals_prof, "arrivals": every > 0,
            "host_cpu": {k: tuple(v) for k, v in HOST_CPU.items()}, "costs": costs, "phases": phases,
            "parts": parts}


async def _window(eng: Engine, seconds: float) -> torch.profiler.profile | pstats.Stats:
    """`seconds` of the worker: torch's profiler, or with `--cprofile` Python's
    over its plans (made and carried out)."""
    if not CPROFILE_ROWS:
        return await eng.profile(seconds)
    prof = worker_profile.start()
    await asyncio.sleep(seconds)
    worker_profile.stop()
    await asyncio.sleep(0.1)  # the plan under way ends
    return pstats.Stats(prof)


# --host-cpu: the worker thread's CPU time (time.thread_time: what it ran, not what it waited for) in item steps
# (a codec's windows) and in feeding a decode group's tokens into their streams; reset at each level
HOST_CPU: dict[str, list[float]] = {}


def _host_timed(owner: type, name: str, counted: Callable[[tuple], tuple[str, int]]) -> None:
    """`owner.name` with its thread CPU time summed under the label `counted(args)` names, with its rows."""
    method = getattr(owner, name)

    def call(*args):
        t0 = time.thread_time()
        try:
            return method(*args)
        finally:
            label, rows = counted(args)
            got = HOST_CPU.setdefault(label, [0.0, 0])
            got[0] += time.thread_time() - t0
            got[1] += rows
    setattr(owner, name, call)


async def _drain(eng: Engine, req: GenerateRequest, parts: FirstAudioParts) -> None:
    async for out in eng.submit(req):
        if out.audio:
            parts.heard(req.request_id)


def _steps_in(reports: list[StepReport]) -> int:
    """Steps the reports cover: a launch of several (`--num-scheduler-steps`) reports them all at once."""
    return sum(getattr(r, "steps", 1) for r in reports)


def show(r: dict, tokens: int) -> None:
    audio_ids = r["audio_s"] * 24_000 / 2048 * 7
    ttfa = r["first_audio"]
    print(f"\n## concurrency {r['c']}: wall {r['wall']:.2f} s, audio {r['audio_s']:.1f} s "
          f"({r['audio_s'] / r['wall']:.1f} audio s/s), ~{audio_ids / max(r['sampled'], 1):.0%} of "
          f"{r['sampled']} sampled tokens became audio; first audio p50 {1e3 * ttfa[len(ttfa) // 2]:.0f} ms"
          if ttfa else f"\n## concurrency {r['c']}: no audio")
    total = sum(x.step_s for reps in r["steps"].values() for x in reps) or 1.0
    print(f"{'component/mode':>16} {'steps':>6} {'rows':>7} {'step ms':>8} {'device ms':>10} {'share':>6}")
    for (comp, mode), reps in sorted(r["steps"].items()):
        n = _steps_in(reps)
        step = sum(x.step_s for x in reps)
        print(f"{comp + '/' + mode:>16} {n:>6} {sum(x.rows for x in reps) / len(reps):>7.1f} {1e3 * step / n:>8.2f} "
              f"{1e3 * sum(x.device_s for x in reps) / n:>10.2f} {step / total:>6.0%}")
    decode = r["steps"].get(("llm", "decode"), [])
    if decode:  # with arrivals streams restart and arrivals add steps: no count per request token
        n = _steps_in(decode)
        per_token = f"decode steps per request token: {n / tokens:.2f}; " if not r["arrivals"] else ""
        launches = f" ({n / len(decode):.2f} steps a launch)" if n != len(decode) else ""
        print(f"{per_token}mean period {1e3 * r['wall'] / n:.2f} ms{launches}")
        ph = {k: 1e3 * v / n for k, v in r["phases"].items()}
        print(f"the worker per decode step: {ph['wait_s']:.2f} ms waiting on the device, {ph['launch_s']:.2f} "
              f"launching, {ph['finalize_s']:.2f} reading the step before; {ph['cpu_s']:.2f} ms of its thread's CPU "
              f"time (item steps included)")
    for who, prefix in (("the level's first requests", "p"), ("arrivals", "a")):
        line = r["parts"].summary(prefix)
        if line:
            print(f"{who}: {line}")
    print(r["costs"].line())
    for label, (cpu_s, rows) in r["host_cpu"].items():
        print(f"worker thread CPU, {label}: {1e6 * cpu_s / max(rows, 1):.2f} us ({rows} rows)")
    for name, key in (("", "prof"), (" (with arrivals)", "arrivals_prof")):
        if r[key] is None:
            continue
        if isinstance(r[key], pstats.Stats):  # --cprofile: the worker's own functions and the libraries' it calls
            print(f"worker's Python in the window{name}, by own time:")
            r[key].sort_stats("tottime").print_stats(CPROFILE_ROWS)
            r[key].sort_stats("cumulative").print_stats("mstar", CPROFILE_ROWS)
            continue
        events = r[key].key_averages()
        cuda = torch.cuda.is_available()
        print(f"worker phases in the trace window{name} (CPU ms total, calls; device ms of their kernels):")
        for e in sorted((e for e in events if e.key.startswith("mstar.")), key=lambda e: -e.cpu_time_total):
            device = f"{e.device_time_total / 1e3:9.1f}" if cuda else ""
            print(f"  {e.key:<24} {e.cpu_time_total / 1e3:9.1f} {e.count:>6} {device}")
        sort = "self_cuda_time_total" if cuda and not r["arrivals_prof"] else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=25 if r["arrivals_prof"] else 18, max_name_column_width=70))
        if sort != "self_cpu_time_total" and TRACE_CPU_ROWS:  # --trace-cpu: the host's side as well
            print(events.table(sort_by="self_cpu_time_total", row_limit=TRACE_CPU_ROWS, max_name_column_width=70))


async def main(a: argparse.Namespace) -> None:
    # room for every arrival of a level beside its streams (at most that many run at once), or they would wait
    # for a stream to end instead of running beside them
    arriving_s = 1.0 + (a.trace or UNTRACED_ARRIVALS_S)
    rows = max(a.concurrency) + (math.ceil(arriving_s / a.arrivals) + 1 if a.arrivals > 0 else 0)
    eng = Engine(EngineConfig(model=a.model, devices=tuple(a.devices.split(",")), load_format=a.load_format,
                              kv_cache_dtype=a.kv_cache_dtype, audio_logits_only=a.audio_logits_only,
                              cuda_graph_batch_sizes=graph_buckets(max(256, rows)),
                              scheduler=SchedulerConfig(max_num_seqs=rows, num_scheduler_steps=a.num_scheduler_steps)))
    await eng.start()
    if a.quiet_gc:
        print(f"# quiet_gc as the server sets it: {http_main.quiet_gc()} objects frozen")
    try:
        # not counted: first uses compile the Triton kernels and warm the allocators
        await level(eng, 2, min(a.tokens, 64), 0.0, 0.0)
        for c in a.concurrency:
            show(await level(eng, c, a.tokens, a.trace, a.trace_after, a.arrivals, a.arrival_tokens), a.tokens)
    finally:
        await eng.shutdown()


def _steps(text: str) -> int | None:
    """The server's `--num-scheduler-steps` value, as argparse's type."""
    try:
        return scheduler_steps(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--devices", default="cuda:0")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--audio-logits-only", action="store_true", help="the server's flag: the head and the draw over "
                   "Orpheus's own ids only")
    p.add_argument("--trace", type=float, default=0.0, help="seconds of torch profiler in each level")
    p.add_argument("--trace-cpu", type=int, default=0, metavar="ROWS",
                   help="with --trace on CUDA, also this many ops by their own host time")
    p.add_argument("--trace-after", type=float, default=1.0,
                   help="when the trace (untraced: the arrivals) starts, in seconds into a level")
    p.add_argument("--arrivals", type=float, default=0.0,
                   help="after the trace, a new short request every this many seconds, traced as long again "
                        "(host time per phase and op, with and without arrivals); without --trace, for 4 s "
                        "untraced. Either way the arrivals' first audio is split in parts (first_audio_parts.py)")
    p.add_argument("--arrival-tokens", type=int, default=140)
    p.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                   help="in the trace windows, Python's profiler over the worker's plans instead of torch's; "
                        "print this many functions")
    p.add_argument("--num-scheduler-steps", type=_steps, default=1,
                   help="the server's flag: decode steps a launch, or auto (default 1)")
    p.add_argument("--quiet-gc", action="store_true", help="Python's collector set as the server sets it")
    p.add_argument("--urgent", nargs="+", default=(), choices=("llm", "codec"),
                   help="an experiment on Orpheus's declaration: these components' CUDA streams at high priority "
                        "(`Component.urgent`; the codec then gets a stream of its own, beside the LLM's groups')")
    p.add_argument("--stub-compute", action="store_true",
                   help="bench_host_speech.py's stand-ins for the model's heavy compute (host cost on the CPU)")
    p.add_argument("--host-cpu", action="store_true",
                   help="print the worker thread's CPU time per row of item steps and per token fed to streams")
    args = p.parse_args()
    if args.host_cpu:
        from mstar.engine.worker.streaming.edges import Streams
        _host_timed(Executor, "_step", lambda a: (f"{a[1].component}/{a[1].mode} item steps, per row", len(a[1].items)))
        _host_timed(Streams, "feed_ids", lambda a: ("a decode group's tokens into their streams, per token",
                                                    sum(len(x) if isinstance(x, list) else 1 for x in a[3])))
    if args.urgent:
        from mstar.models.orpheus.model import OrpheusModel
        urgent = set(args.urgent)  # a plain component takes the priority on a stream of its own
        OrpheusModel.components = {
            name: dataclasses.replace(c, urgent=name in urgent, own_stream=c.own_stream or (
                name in urgent and not c.kv_cache)) for name, c in OrpheusModel.components.items()}
    if args.stub_compute:
        from bench_host_speech import apply_stubs  # this script's folder is on the path
        apply_stubs(defaultdict(int), None)
    CPROFILE_ROWS = args.cprofile
    TRACE_CPU_ROWS = args.trace_cpu
    if CPROFILE_ROWS:
        worker_profile.install()
    print(f"# {platform.platform()} | python {platform.python_version()} | torch {torch.__version__} "
          f"| {os.cpu_count()} cpus | model {args.model} ({args.load_format}) on {args.devices} "
          f"| kv {args.kv_cache_dtype}{' | audio logits only' if args.audio_logits_only else ''}"
          f"{' | urgent ' + ','.join(args.urgent) if args.urgent else ''}")
    asyncio.run(main(args))
