"""Decode attention over a bf16 or an fp8 (e4m3) KV cache, on one CUDA device.

FlashInfer's paged decode at the Orpheus-3B attention shape (24 query heads,
8 KV heads, head_dim 128, bf16 queries, page size 16): `--batches` rows, each
attending over `--context` tokens on shuffled pages, with the KV pages in
bf16 or in float8_e4m3fn (scale 1: FlashInfer converts each key and value to
the query's type as it loads them). For each KV dtype and each decode kernel
(CUDA cores, or the FA2 prefill kernel on tensor cores) it prints:

  attend_us   one layer's attention, kernel only (calls captured in a CUDA graph,
              cycling over layers whose KV is well past L2)
  kv_gbps     K and V bytes read by one attention / attend_us
  max_err     against the same kernel over bf16 pages holding the fp8 values
              (the kernel's own error: 0 means it reads fp8 as bf16 would)
  quant_err   |out(fp8 pages) - out(bf16 pages)| max: what storing in fp8 costs
              on these random keys (std 1) and values

It answers one question before the KV cache grows an fp8 option: does an fp8
cache make decode attention faster at 64-400 rows on this GPU. With
`--no-split`, bf16 rows again with FlashInfer's split-KV off; with `--xqa`,
TensorRT-LLM's XQA kernel (FlashInfer's `xqa` decode backend, no plan) over
bf16 and fp8 pages.

    python3 scripts/bench_kv_dtype.py --batches 64 256 400 --context 560
    python3 scripts/bench_kv_dtype.py --batches 400 --context 140 --no-split
"""

from __future__ import annotations

import argparse
import json
import math

import flashinfer
import torch
from bench_env import REPO, commit, version
from bench_page_size import graph_time_us

HQ, HKV, D, PAGE = 24, 8, 128, 16
LAYERS = 4
FP8 = torch.float8_e4m3fn


def measure(batch: int, context: int, kv_dtype: torch.dtype, tensor_cores: bool,
            no_split: bool = False, xqa: bool = False) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(batch)
    per_row = math.ceil(context / PAGE)
    pages = batch * per_row
    shape = (pages, PAGE, HKV, D)
    # one float set of pages per layer; the fp8 run stores it rounded to fp8, the reference run holds the
    # same rounded values in bf16, so max_err is the kernel's and quant_err the storage's
    exact = [(torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16),
              torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    if kv_dtype == FP8:
        stored = [(k.to(FP8), v.to(FP8)) for k, v in exact]
        as_bf16 = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in stored]
    else:
        stored = as_bf16 = exact
    order = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * per_row
    last = torch.full((batch,), context - (per_row - 1) * PAGE, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)

    def wrapper(kv: torch.dtype):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tensor_cores)
        w.plan(indptr, order, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv,
               disable_split_kv=no_split)
        return w

    ref = wrapper(torch.bfloat16)
    if xqa:   # TensorRT-LLM's XQA through FlashInfer: no plan, the page table and lengths as tensors
        table = order.view(batch, per_row)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda").to(torch.uint32)
        space = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        o = torch.empty_like(q)

        def run(_q, kv):
            return flashinfer.decode.xqa_batch_decode_with_kv_cache(
                _q, kv, space, table, lens, context, bmm1_scale=D ** -0.5, out=o)
    else:
        w = wrapper(kv_dtype)
        run = w.run
    out = run(q, stored[0]).clone()
    max_err = (out.float() - ref.run(q, as_bf16[0]).float()).abs().max().item()
    quant_err = (out.float() - ref.run(q, exact[0]).float()).abs().max().item()
    attend_us = graph_time_us(lambda i: run(q, stored[i % LAYERS]))
    kv_bytes = 2 * batch * context * HKV * D * torch.empty((), dtype=kv_dtype).element_size()
    return dict(batch=batch, context=context, kv_dtype=str(kv_dtype).removeprefix("torch."),
                decode="xqa" if xqa else "tensor cores" if tensor_cores else "CUDA cores",
                split_kv="off" if no_split else "auto",
                attend_us=round(attend_us, 2),
                kv_gbps=round(kv_bytes / attend_us / 1e3, 1), max_err=max_err, quant_err=quant_err)


def prebuild() -> None:
    """The fp8 variants of FlashInfer's decode and FA2 prefill modules in one parallel JIT build."""
    from flashinfer.jit import build_jit_specs, gen_batch_decode_module, gen_batch_prefill_module

    bf16, idx = torch.bfloat16, torch.int32
    build_jit_specs([gen_batch_prefill_module("fa2", bf16, FP8, bf16, idx, D, D, 0, False, False, False),
                     gen_batch_decode_module(bf16, FP8, bf16, idx, D, D, 0, False, False)], verbose=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 400])
    p.add_argument("--context", type=int, default=560)
    p.add_argument("--no-split", action="store_true",
                   help="also bf16 pages with FlashInfer's split of long rows off (`disable_split_kv`): at short "
                        "contexts and many rows the split's merge may cost more than it spreads")
    p.add_argument("--xqa", action="store_true",
                   help="also TensorRT-LLM's XQA decode kernel (FlashInfer's `xqa` backend) over bf16 and fp8 pages")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashinfer {version('flashinfer-python')}, "
          f"commit {commit(REPO)}; Hq {HQ} Hkv {HKV} D {D}, page {PAGE}, context {a.context}")
    prebuild()
    rows = []
    for batch in a.batches:
        for kv in (torch.bfloat16, FP8):
            for tc in (False, True):
                try:
                    rows.append(measure(batch, a.context, kv, tc))
                except Exception as exc:  # an unsupported combination is a result too
                    rows.append(dict(batch=batch, context=a.context, kv_dtype=str(kv), tensor_cores=tc,
                                     error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
        for kv in (torch.bfloat16, FP8) if a.xqa else ():
            try:
                rows.append(measure(batch, a.context, kv, True, xqa=True))
            except Exception as exc:
                rows.append(dict(batch=batch, context=a.context, kv_dtype=str(kv), decode="xqa",
                                 error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(rows[-1], flush=True)
        for tc in (False, True) if a.no_split else ():
            rows.append(measure(batch, a.context, torch.bfloat16, tc, no_split=True))
            print(rows[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(commit=commit(REPO), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
