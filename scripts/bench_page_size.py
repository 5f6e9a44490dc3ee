"""Decode attention time per KV page size, on one CUDA device.

FlashInferAttention's CUDA-graph decode bucket at the Orpheus-3B attention
shape (24 query heads, 8 KV heads, head_dim 128, bf16): `--batch` rows, each
attending over `--context` tokens (context - 1 cached + the new one) on
shuffled pages. For each page size and each decode kernel (CUDA cores, or the
prefill kernel on tensor cores) it prints:

  attend_us   one layer's attention, kernel only (calls captured in a CUDA graph)
  forward_us  one layer's context forward: KV write + attention (graph too)
  kv_gbps     K and V bytes read by one attention / attend_us
  plan_us     host time of one plan_graph (page lists built, copied, planned)
  max_err     against TorchPagedAttention on the same cache

usage: python3 scripts/bench_page_size.py [--batch 64] [--context 512]
       [--page-sizes 1 16 32 64] [--tensor-cores both|on|off] [--split-kv on|off|both]
       [--batches 1 16 64] [--contexts 512 1024] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.memory.flashinfer_attention import FlashInferAttention, FlashInferContext, build_kernels
from mstar.engine.memory.kv_cache import KVCache
from mstar.models.base import KVSpec

HQ, HKV, D = 24, 8, 128
LAYERS = 4       # calls cycle over layers: each layer's KV (134 MB at batch 64) is well past L2
CALLS = 40       # attention calls per captured graph
REPLAYS = 10


def graph_time_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per call of fn(i), from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm up outside the graph: lazy inits, Triton compiles
            fn(i)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def measure(page_size: int, tensor_cores: bool, batch: int, context: int, seed: int = 0,
            split_kv: bool = True) -> dict[str, float | int | str | bool]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_row = math.ceil(context / page_size)
    num_pages = batch * per_row + 1
    cache = KVCache(KVSpec(LAYERS, HKV, D), num_pages, page_size, "cuda", torch.bfloat16)
    for t in cache.k + cache.v:
        t.normal_(generator=gen)
    tables = torch.randperm(num_pages, generator=gen, device="cuda")[:batch * per_row].view(batch, per_row).cpu()
    context_lens = torch.full((batch,), context - 1, dtype=torch.long)
    attn = FlashInferAttention(cache, HQ, graph_batch_sizes=(batch,), max_pages_per_row=per_row,
                               decode_tensor_cores=tensor_cores, split_kv=split_kv)
    ctx: FlashInferContext = attn.plan_graph(batch, context_lens, tables)
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
    scale = D ** -0.5

    out = ctx.forward(0, q, k, v, scale)
    ref = TorchPagedAttention(cache, torch.arange(batch + 1), context_lens, tables).forward(0, q, k, v, scale)
    max_err = (out.float() - ref.float()).abs().max().item()

    attend_us = graph_time_us(lambda i: ctx.attend(i % LAYERS, q, scale))
    forward_us = graph_time_us(lambda i: ctx.forward(i % LAYERS, q, k, v, scale))
    t0 = time.perf_counter()
    for _ in range(50):
        attn.plan_graph(batch, context_lens, tables)
    plan_us = (time.perf_counter() - t0) * 1e6 / 50
    kv_bytes = 2 * batch * context * HKV * D * 2
    del attn, cache
    torch.cuda.empty_cache()
    return dict(page_size=page_size, decode="tensor cores" if tensor_cores else "CUDA cores", split_kv=split_kv,
                attend_us=round(attend_us, 2), forward_us=round(forward_us, 2),
                kv_gbps=round(kv_bytes / attend_us / 1e3, 1), plan_us=round(plan_us, 1), max_err=max_err)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 32, 64])
    p.add_argument("--tensor-cores", choices=("both", "on", "off"), default="both")
    p.add_argument("--split-kv", choices=("both", "on", "off"), default="on",
                   help="whether a row's keys may split over programs (FlashInfer's default), or both ways")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="several batch sizes (replaces --batch)")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="several contexts (replaces --context)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    build_kernels(torch.bfloat16, D)
    ways = {"both": (False, True), "on": (True,), "off": (False,)}
    batches, contexts = a.batches or [a.batch], a.contexts or [a.context]
    rows = [dict(batch=b, context=c) | measure(ps, tc, b, c, split_kv=sk)
            for b in batches for c in contexts for ps in a.page_sizes
            for tc in ways[a.tensor_cores] for sk in ways[a.split_kv][::-1]]
    print(f"decode attention, Hq {HQ} Hkv {HKV} D {D} bf16, {torch.cuda.get_device_name()}")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2e}" if c == "max_err" else str(r[c]) for c in cols) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(batches=batches, contexts=contexts, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
