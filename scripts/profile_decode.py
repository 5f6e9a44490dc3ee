"""Kernels by time in one decode step of a served language model (the GPU
machine): Llama shapes, or Qwen3.5's with a state slot per row.

Builds the component the engine builds (`--model`, dummy weights by default),
fills a paged KV cache for `--batch` rows of `--context` tokens, and profiles
eager decode steps (forward + greedy sampling) with torch.profiler; prints the
kernels that take the most GPU time per step, then the time of the same step
replayed as a CUDA graph.

    python scripts/profile_decode.py --batch 1 64 --context 512
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mstar.config import EngineConfig
from mstar.engine.execution.backends import attention_backend
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.state_slots import StatePool
from mstar.engine.execution.sampler import SamplingTensors, sample
from mstar.models.registry import load_model
from mstar.types import SamplingParams, StateRows, TokenBatch


def profile_batch(model_name: str, batch: int, context: int, steps: int, top: int) -> None:
    dev = torch.device("cuda:0")
    model = load_model(model_name, "dummy")
    module = model.build_component("llm", dev, torch.bfloat16)
    spec = model.kv_spec("llm")
    page = 16
    per_row = -(-(context + steps + 8) // page)
    cache = KVCache(spec, batch * per_row, page, dev, torch.bfloat16)
    cfg = EngineConfig(cuda_graph_batch_sizes=(batch,))
    attn = attention_backend(cache, spec.num_q_heads, per_row, cfg)
    tables = torch.arange(batch * per_row).reshape(batch, per_row)
    ctx = torch.full((batch,), context, dtype=torch.long)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=dev)
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * batch, [0] * batch, [0] * batch, dev)
    qs = torch.arange(batch + 1)
    has_state = model.components["llm"].state
    pool = StatePool(model.state_spec("llm"), batch, dev) if has_state else None
    slots = torch.arange(batch)

    def step() -> torch.Tensor:
        rows = StateRows(pool.tensors, slots.to(dev), host=slots.tolist()) if pool is not None else None
        b = TokenBatch(input_ids=tokens, positions=ctx.to(dev), query_start=qs,
                       logits_index=torch.arange(batch, device=dev), attn=attn.plan(qs, ctx, tables), state=rows)
        return sample(module.decode(b)["logits"], st)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / steps
    print(f"\n## batch {batch}, context {context}: {total / 1e3:.3f} ms of kernels per eager step")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for e in events[:top]:
        print(f"{e.device_time_total / steps:9.1f} {e.count / steps:10.1f}  {e.key[:110]}")

    graphs = DecodeGraphs(module.decode, attn, (batch,), dev, state=pool)
    graphs.capture(show_progress=False)
    slot_arg = slots if pool is not None else None
    for _ in range(3):
        graphs.run(tokens, ctx, tables, slots=slot_arg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        sample(graphs.run(tokens, ctx, tables, slots=slot_arg)["logits"], st)
    torch.cuda.synchronize()
    print(f"CUDA graph step (with planning and sampling): {(time.perf_counter() - t0) / steps * 1e3:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name(0)} | torch {torch.__version__} | model {a.model}")
    for b in a.batch:
        profile_batch(a.model, b, a.context, a.steps, a.top)


if __name__ == "__main__":
    main()
