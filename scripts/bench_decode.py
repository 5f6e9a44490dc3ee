"""Decode speed against the bandwidth floor, on one device.

Measures, in one run: the device's copy bandwidth; mstar's median decode step
at each batch x context (one Engine in-process for all rows; B concurrent
greedy `ignore_eos` requests whose prompt is `context` tokens, timed from the
StepReports of decode steps with all B rows); the floor of each step (weights
+ KV read, over the copy bandwidth); mstar's decode tokens/s at the first
context; and transformers' `generate` at batch 1 and 16 with the same shape.
Writes a JSON file and a markdown table beside it.

On the H200 (orpheus-3b with random weights, the default; from the repo root,
PYTHONPATH=. where mstar is not pip-installed):
    python scripts/bench_decode.py --out docs/benchmarks/decode.json
A CPU smoke test:
    python scripts/bench_decode.py --model tiny-llama --gpus cpu --batches 1 4 --contexts 32 \\
        --new-tokens 8 --skip-hf --out /tmp/x.json
Qwen3.5 (its floor adds each row's recurrent state, read and written once a
step; transformers' baseline is its own Qwen3_5ForCausalLM):
    python scripts/bench_decode.py --model qwen3.5-9b --batches 1 64 256 --contexts 512 \\
        --out docs/benchmarks/qwen35.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# sibling modules: the script's folder is first on sys.path
from decode_measures import (GiB, build_hf, build_hf_qwen35, copy_bandwidth_gbps, hf_decode_tokens_per_s,
                             kv_bytes_per_step, module_weight_bytes, state_bytes_per_step, weight_bytes_per_step)
from decode_report import environment, write_markdown
from mstar.config import EngineConfig, SchedulerConfig, parse_devices
from mstar.engine.engine import Engine
from mstar.engine.messages import StepReport
from mstar.models.base import Model
from mstar.models.checkpoint import read_json
from mstar.models.llama import LlamaModel
from mstar.models.qwen3_5 import builtins as qwen35_builtins
from mstar.models.qwen3_5.model import Qwen35Model
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Run:
    """Reports of one batch x context run, as the event loop sees them."""

    batch: int
    full: list[StepReport] = field(default_factory=list)  # decode steps with all rows
    decode_tokens: int = 0          # rows of decode steps after the last prefill
    last_prefill_at: float = 0.0

    def on_report(self, r: StepReport) -> None:
        if r.mode == "prefill":
            self.last_prefill_at = time.perf_counter()
            self.decode_tokens = 0
        elif r.mode == "decode":
            self.decode_tokens += r.rows * getattr(r, "steps", 1)
            if r.rows == self.batch:
                self.full.append(r)


class Bench:
    """One engine, runs of B concurrent requests on it."""

    def __init__(self, engine: Engine, new_tokens: int) -> None:
        self.engine = engine
        self.new_tokens = new_tokens
        self.run: Run | None = None
        engine.add_report_hook(self._hook)

    def _hook(self, r: StepReport) -> None:
        if self.run is not None:
            self.run.on_report(r)

    async def measure(self, batch: int, context: int, new_tokens: int | None = None) -> tuple[Run, float]:
        """The run's reports and its decode wall time: from the last prefill
        report to the last request's end."""
        n = new_tokens or self.new_tokens
        self.run = run = Run(batch)
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        gen = torch.Generator().manual_seed(context)
        # byte ids: inside every Llama vocab here and the byte tokenizer's
        prompts = torch.randint(0, 256, (batch, context), generator=gen).tolist()

        async def one(i: int) -> None:
            # the LLM's own walk: a speech model's default walk would also run its codec
            req = GenerateRequest(f"b{batch}c{context}r{i}", self.engine.model_name, {"prompt_ids": prompts[i]}, sp,
                                  walk="generate")
            async for _ in self.engine.submit(req):
                pass

        await asyncio.gather(*(one(i) for i in range(batch)))
        wall = time.perf_counter() - run.last_prefill_at
        self.run = None
        return run, wall


def row_of(run: Run, batch: int, context: int, new_tokens: int, weights: int, spec, dtype, gbps: float,
           state=None) -> dict:
    """`state`: the model's per-row `StateSpec`, whose bytes a step reads and writes (None: no state)."""
    if not run.full:
        raise SystemExit(f"batch {batch} context {context}: no decode step ran with all {batch} rows")
    # a launch of several steps reports once for them all (a tree older than such launches has no `steps`)
    step = statistics.median(r.step_s / getattr(r, "steps", 1) for r in run.full)
    host = statistics.median((r.step_s - r.device_s) / getattr(r, "steps", 1) for r in run.full)
    # the context grows by one per step: take its mean over the decode steps
    moved = weights + kv_bytes_per_step(spec, dtype, batch, context + new_tokens / 2)
    floor = (moved + (state_bytes_per_step(state, batch) if state is not None else 0)) / (gbps * 1e9)
    return {"batch": batch, "context": context, "step_ms": round(1e3 * step, 3), "floor_ms": round(1e3 * floor, 3),
            "ratio": round(step / floor, 2), "host_ms": round(1e3 * host, 3)}


async def bench_engine(a: argparse.Namespace, model: Model, device: torch.device, dtype: torch.dtype,
                       gbps: float) -> tuple[list[dict], list[dict]]:
    page = a.page_size
    per_row = -(-(max(a.contexts) + a.new_tokens) // page) + 1  # +1: room for a step launched ahead
    # the worker insists that one request of max_model_len fits
    pages = a.num_pages or max(max(a.batches) * per_row, -(-model.max_model_len // page))
    # the decode graphs follow max_num_seqs, as the server's do by default
    cfg = EngineConfig(model=a.model, load_format=a.load_format, devices=(str(device),), dtype=a.dtype,
                       max_model_len=a.max_model_len, quantization=a.quantization,
                       scheduler=SchedulerConfig(max_num_seqs=max(256, *a.batches), page_size=page, num_pages=pages,
                                                 max_num_batched_tokens=a.max_num_batched_tokens,
                                                 **({"num_scheduler_steps": a.num_scheduler_steps}
                                                    if a.num_scheduler_steps > 1 else {})))
    engine = Engine(cfg, model=model)
    t0 = time.perf_counter()
    await engine.start()
    print(f"# engine started in {time.perf_counter() - t0:.1f} s ({pages} KV pages of {page})", flush=True)
    bench = Bench(engine, a.new_tokens)
    state = model.state_spec("llm") if model.components["llm"].state else None
    if isinstance(model, LlamaModel) and not a.quantization:
        weights = weight_bytes_per_step(model.config, torch.empty((), dtype=dtype).element_size())
    else:  # every weight once, as stored (a MoE decoder's floor would count only the experts a step routes to)
        weights = module_weight_bytes(engine.workers[0].runners["llm"].module)
    spec = model.kv_spec("llm")
    try:
        await bench.measure(max(a.batches), min(a.contexts), 4)  # warm-up: allocator, lazy kernels
        rows, tps = [], []
        print(f"{'batch':>6} {'context':>8} {'steps':>6} {'step ms':>8} {'floor ms':>9} {'ratio':>6} "
              f"{'host ms':>8} {'tok/s':>9}", flush=True)
        for context in a.contexts:
            for batch in a.batches:
                run, wall = await bench.measure(batch, context)
                row = row_of(run, batch, context, a.new_tokens, weights, spec, dtype, gbps, state)
                rows.append(row)
                rate = run.decode_tokens / wall
                if context == a.contexts[0]:
                    tps.append({"batch": batch, "tokens_per_s": round(rate, 1)})
                print(f"{batch:>6} {context:>8} {len(run.full):>6} {row['step_ms']:>8.2f} {row['floor_ms']:>9.2f} "
                      f"{row['ratio']:>6.2f} {row['host_ms']:>8.2f} {rate:>9.0f}", flush=True)
    finally:
        await engine.shutdown()
    return rows, tps


def bench_hf(a: argparse.Namespace, model: Model, device: torch.device, dtype: torch.dtype) -> list[dict]:
    if isinstance(model, Qwen35Model):
        raw = read_json(model.path / "config.json") if model.path is not None else \
            qwen35_builtins.BY_NAME[a.model]
        hf = build_hf_qwen35(raw, device, dtype)
    else:
        hf = build_hf(model.config, device, dtype)
    out = []
    for batch in a.hf_batches:
        rate = hf_decode_tokens_per_s(hf, batch, a.contexts[0], a.new_tokens, device)
        out.append({"batch": batch, "tokens_per_s": round(rate, 1)})
        print(f"# transformers generate: batch {batch} context {a.contexts[0]}: {rate:.0f} tokens/s", flush=True)
    del hf
    return out


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--gpus", default="0" if torch.cuda.is_available() else "cpu", help="one device: 0 | cpu")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--copy-gib", type=float, default=1.0, help="size of the bandwidth copy")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: enough for the largest run")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps a launch (the server's flag)")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="the server's flag: float8 projections (the floor then counts their bytes as stored)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks/decode.json"))
    a = p.parse_args()
    if a.new_tokens < 3:
        p.error("--new-tokens must be at least 3 (prefill makes the first token)")
    return a


def main() -> None:
    a = parse()
    (device_name,) = parse_devices(a.gpus)
    device = torch.device(device_name)
    model = load_model(a.model, a.load_format, a.max_model_len)
    if not isinstance(model, (LlamaModel, Qwen35Model)):
        raise SystemExit(f"{a.model}: bench_decode measures Llama-family and Qwen3.5 models only")
    if isinstance(model, Qwen35Model) and model.config.num_experts:
        # its floor would count every expert's weights once a step, not the ones the step routes to
        raise SystemExit(f"{a.model}: a MoE decoder's bandwidth floor is not modelled here; dense shapes only")
    if max(a.contexts) + a.new_tokens > model.max_model_len:
        raise SystemExit(f"context {max(a.contexts)} + {a.new_tokens} new tokens exceed max_model_len "
                         f"{model.max_model_len}: pass --max-model-len")
    dtype = DTYPES.get(a.dtype) or model.default_dtype(device)
    env = environment(device, a, dtype)
    if a.num_scheduler_steps > 1:
        env["num scheduler steps"] = a.num_scheduler_steps
    print("# " + " | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    gbps = copy_bandwidth_gbps(device, int(a.copy_gib * GiB))
    print(f"# copy bandwidth {gbps:.0f} GB/s (read + write)", flush=True)
    rows, tps = asyncio.run(bench_engine(a, model, device, dtype, gbps))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = [] if a.skip_hf else bench_hf(a, model, device, dtype)
    result = {"gpu": env["gpu"], "copy_GBps": round(gbps, 1), "rows": rows, "hf": hf, "mstar_tokens_per_s": tps}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    md = a.out.with_suffix(".md")
    write_markdown(md, result, env)
    print(f"# wrote {a.out} and {md}", file=sys.stderr)


if __name__ == "__main__":
    main()
