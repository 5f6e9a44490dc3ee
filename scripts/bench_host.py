"""Host work per decode step as the batch grows.

Runs the engine in-process on `--model` (default: the built-in tiny-llama, on
CPU) with N concurrent greedy requests of a fixed length, and reports per
decode step: the whole step on the worker, the part spent in forward and
sampling, the host work around them (batch building, input preparation,
routing, stop checks, hand-off), the event loop's time handling the
step's report, and each thread's CPU time per step over the run (the worker's
counts CUDA's spinning wait for a step's event; under one GIL a step takes at
least the two threads' Python).

    python scripts/bench_host.py --batches 1 64 256 --tokens 64
    python scripts/bench_host.py --model orpheus-3b --load-format dummy --devices cuda:0 --batches 256 \
        --tokens 200 --cprofile 40

`--cprofile N`: Python's profiler over the worker's plans (made and carried
out) at each batch, its N most costly functions by own time and by
cumulative time among mstar's: where a step's host time goes, function by
function (the profiler slows the host: read the shares, not the times).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import pstats
import statistics
import time

import torch

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.types import GenerateRequest, SamplingParams

import worker_profile  # this script's folder is on the path


def launched(r: StepReport) -> int:
    """Decode steps the report's launch ran (a tree older than multi-step launches ran one)."""
    return getattr(r, "steps", 1)


async def measure(model: str, devices: tuple[str, ...], batch: int, tokens: int, load_format: str,
                  profile_rows: int = 0, steps: int = 1) -> dict:
    scheduler = SchedulerConfig(max_num_seqs=max(batch, 1))
    if steps > 1:  # a tree older than --num-scheduler-steps takes the default
        scheduler = dataclasses.replace(scheduler, num_scheduler_steps=steps)
    eng = Engine(EngineConfig(model=model, devices=devices, load_format=load_format, scheduler=scheduler))
    await eng.start()
    steps: list[StepReport] = []
    loop_s: list[float] = []
    full_loop_s: list[float] = []  # per decode step of a launch with every row
    t_in = 0.0

    def before(_r: StepReport) -> None:
        nonlocal t_in
        t_in = time.perf_counter()

    def after(r: StepReport) -> None:
        loop_s.append(time.perf_counter() - t_in)
        if r.mode == "decode" and r.rows == batch:
            steps.append(r)
            full_loop_s.append(loop_s[-1] / launched(r))

    eng.add_report_hook(before, before=True)
    eng.add_report_hook(after)
    prompt = list(range(10, 42))
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        # the LLM's own walk: a speech model's default walk would also run its codec
        request = GenerateRequest(f"r{i}", eng.model_name, {"prompt_ids": prompt}, sp, walk="generate")
        async for _ in eng.submit(request):
            pass

    if profile_rows:
        worker_profile.start()
    worker_cpu_s = getattr(eng.workers[0], "cpu_s", lambda: 0.0)  # 0: a tree older than it (compare runs)
    t0, loop_cpu0, worker_cpu0 = time.perf_counter(), time.thread_time(), worker_cpu_s()
    await asyncio.gather(*[one(i) for i in range(batch)])
    wall = time.perf_counter() - t0
    loop_cpu, worker_cpu = time.thread_time() - loop_cpu0, worker_cpu_s() - worker_cpu0
    prof = worker_profile.stop()
    st = eng.workers[0].stats
    await eng.shutdown()
    med = statistics.median
    return {
        "batch": batch,
        "decode_steps": sum(launched(r) for r in steps),
        "step_ms": 1e3 * med(r.step_s / launched(r) for r in steps),
        "device_ms": 1e3 * med(r.device_s / launched(r) for r in steps),
        "host_ms": 1e3 * med((r.step_s - r.device_s) / launched(r) for r in steps),
        "loop_ms_per_report": 1e3 * med(loop_s),
        "loop_ms_per_step": 1e3 * med(full_loop_s),
        "tokens_per_s": batch * tokens / wall,
        # per decode group step, from the worker's phase counters
        "wait_ms": 1e3 * st.wait_s / max(st.steps, 1),
        "launch_ms": 1e3 * st.launch_s / max(st.steps, 1),
        "finalize_ms": 1e3 * st.finalize_s / max(st.steps, 1),
        # the two threads' CPU time over the run, per step: under one GIL a step takes at least their Python
        "worker_cpu_ms": 1e3 * worker_cpu / max(st.steps, 1),
        "loop_cpu_ms": 1e3 * loop_cpu / max(st.steps, 1),
        "profile": prof,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps a launch (the server's flag)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="Python's profiler over the worker at each batch: its N costliest functions")
    a = p.parse_args()
    if a.cprofile:
        worker_profile.install()
    print(f"# {platform.platform()} | python {platform.python_version()} | torch {torch.__version__} "
          f"| {os.cpu_count()} cpus | threads {torch.get_num_threads()} | model {a.model} on {a.devices}")
    print("step = period between decode steps; device = blocked on the device (CPU: compute); host = step - device;")
    print("loop = event loop per decode step (a launch's report over its steps); wait/launch/finalize = the "
          "worker's phases per step;")
    print("cpu w / l = the worker's and the event loop's thread CPU time per step, over the whole run")
    print(f"{'batch':>6} {'steps':>6} {'step ms':>8} {'device ms':>10} {'host ms':>8} {'loop ms':>8} "
          f"{'wait':>6} {'launch':>7} {'final':>6} {'cpu w':>6} {'cpu l':>6} {'tok/s':>9}")
    for b in a.batches:
        r = asyncio.run(measure(a.model, tuple(a.devices.split(",")), b, a.tokens, a.load_format, a.cprofile,
                                a.num_scheduler_steps))
        print(f"{r['batch']:>6} {r['decode_steps']:>6} {r['step_ms']:>8.2f} {r['device_ms']:>10.2f} "
              f"{r['host_ms']:>8.2f} {r['loop_ms_per_step']:>8.2f} {r['wait_ms']:>6.2f} {r['launch_ms']:>7.2f} "
              f"{r['finalize_ms']:>6.2f} {r['worker_cpu_ms']:>6.2f} {r['loop_cpu_ms']:>6.2f} {r['tokens_per_s']:>9.0f}")
        if r["profile"] is not None:
            print(f"\n## batch {b}: the worker's Python, {r['decode_steps']} full decode steps", flush=True)
            stats = pstats.Stats(r["profile"])
            stats.sort_stats("tottime").print_stats(a.cprofile)
            stats.sort_stats("cumulative").print_stats("mstar", a.cprofile)


if __name__ == "__main__":
    main()
