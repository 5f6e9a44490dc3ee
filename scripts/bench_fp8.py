"""fp8 projections (`--quantization fp8`) against bf16: their time, and what
they do to the tokens.

1. The projections of an Orpheus-3B step (28 layers of qkv 3072->5120,
   o 3072->3072, gate_up 3072->16384, down 8192->3072, each layer its own
   weights) at each row count, from CUDA graphs: bf16 (`F.linear`), float8
   rows and weights (`torch._scaled_mm`, the rows' quantization included).
2. The engine serving `--model` (dummy weights) with and without fp8: greedy
   tokens of the `generate` walk for a few prompts (how many agree with bf16
   before the first difference, and in all) and the first position's top-5
   logprobs (largest difference). Random weights say little of a trained
   model's quality; with a local checkpoint pass `--model /path`.

    python scripts/bench_fp8.py --rows 1 64 256 400 [--model orpheus-3b] [--tokens 64]
    python scripts/bench_fp8.py --device cpu --model tiny-llama --skip-gemms --tokens 16   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from typing import Callable

import torch
import torch.nn.functional as F

from mstar.config import EngineConfig
from mstar.engine.engine import Engine
from mstar.kernels.quantize import quantize_rows_reference
from mstar.models.layers.fp8 import fp8_linear
from mstar.types import GenerateRequest, SamplingParams

SHAPES = {"qkv": (3072, 5120), "o": (3072, 3072), "gate_up": (3072, 16384), "down": (8192, 3072)}
LAYERS = 28


def _layers(seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """LAYERS layers of the four projections, each its own weights (a chain reads 5.6 GB in bf16, so
    nothing stays in L2 from one call to the next): (bf16 weight, float8 weight, its row scales)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        layer = []
        for k, n in SHAPES.values():
            w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            q, scale = quantize_rows_reference(w)
            layer.append((w, q, scale.reshape(-1)))
        out.append(layer)
    return out


def _step_ms(layers: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], m: int,
             gemm: Callable[..., torch.Tensor]) -> float:
    """A 28-layer step's four projections at m rows, from one CUDA graph over the layers in turn."""
    from bench_page_size import graph_time_us   # it needs FlashInfer: the CPU smoke run skips the GEMMs
    xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in SHAPES.values()}

    def layer(i: int) -> None:
        for (k, _n), ws in zip(SHAPES.values(), layers[i % LAYERS]):
            gemm(xs[k], *ws)
    return graph_time_us(layer, calls=LAYERS, replays=20) * LAYERS / 1e3


def gemms(rows: list[int]) -> None:
    layers = _layers()
    forms = {"bf16": lambda x, w, q, s: F.linear(x, w),
             "fp8 rows+weights (_scaled_mm)": lambda x, w, q, s: fp8_linear(x, q, s, None)}
    print("a 28-layer step's projections, ms (each layer its own weights), from CUDA graphs:")
    print(f"{'rows':>5} " + " ".join(f"{name:>30}" for name in forms))
    for m in rows:
        print(f"{m:>5} " + " ".join(f"{_step_ms(layers, m, f):>30.3f}" for f in forms.values()), flush=True)


async def _served(model: str, device: str, quantization: str | None, prompts: list[list[int]], tokens: int):
    eng = Engine(EngineConfig(model=model, load_format="dummy", devices=(device,), quantization=quantization))
    await eng.start()
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)

        async def one(i: int, ids: list[int]):
            got, top = [], []
            req = GenerateRequest(f"p{i}", eng.model_name, {"prompt_ids": ids}, params, walk="generate")
            async for out in eng.submit(req):
                got += out.token_ids
                top += [dict(lp.top) for lp in out.logprobs or ()]
            return got, top
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    finally:
        await eng.shutdown()


def tokens(model: str, device: str, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 250, (24 + 8 * i,), generator=g).tolist() for i in range(8)]
    full = asyncio.run(_served(model, device, None, prompts, n))
    fp8 = asyncio.run(_served(model, device, "fp8", prompts, n))
    print(f"greedy tokens, {model} (dummy weights), {len(prompts)} prompts x {n} tokens:")
    same_total, first_diffs, lp_diff, same_sets = 0, [], 0.0, 0
    for (a, ta), (b, tb) in zip(full, fp8):
        same_total += sum(x == y for x, y in zip(a, b))
        first_diffs.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
        same_sets += set(ta[0]) == set(tb[0])
        lp_diff = max([lp_diff] + [abs(tb[0][t] - lp) for t, lp in ta[0].items() if t in tb[0]])
    print(f"  agree with the unquantized model: {same_total}/{len(prompts) * n} tokens; tokens before the first "
          f"difference, per prompt: {first_diffs}")
    print(f"  first position's top-5: the same tokens in {same_sets}/{len(prompts)} prompts; largest logprob "
          f"difference over the tokens in both {lp_diff:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 400])
    p.add_argument("--model", default="orpheus-3b")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cuda:0", help="where the engine serves (cpu: the reference, a smoke run)")
    p.add_argument("--skip-tokens", action="store_true", help="the GEMMs only")
    p.add_argument("--skip-gemms", action="store_true", help="the tokens only")
    a = p.parse_args()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"# {platform.platform()} | torch {torch.__version__} | {gpu} | commit {os.environ.get('MSTAR_COMMIT', '?')}")
    if not a.skip_gemms:
        gemms(a.rows)
    if not a.skip_tokens:
        tokens(a.model, a.device, a.tokens)


if __name__ == "__main__":
    main()
