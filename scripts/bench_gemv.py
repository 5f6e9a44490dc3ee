"""The few-row projection kernels (`mstar.kernels.projection`) against cuBLAS,
at Orpheus-3B's shapes: each projection alone (with the norm before it and the
SiLU-and-multiply after it where a decoder layer has them), over a sweep of
tilings (launched as programmatic dependents where the GPU has them; the
default tiling also without), then a whole 28-layer step's projections both ways. Every layer has
its own weights (5.6 GB in all), so nothing is read from L2 twice; times come
from CUDA graphs, so launch gaps inside the graph count, host time does not.
With `--fp8` the layers' weights are float8 rows with their scales
(`--quantization fp8`) and the baseline is the fp8 GEMM path (the row
quantizer and `torch._scaled_mm`) that more rows take.

    python scripts/bench_gemv.py --rows 1 2 4 --out $OUT/gemv.json     # device tool, carry .wheels
    python scripts/bench_gemv.py --rows 1 --fp8 --out $OUT/gemv_fp8.json
    python scripts/bench_gemv.py --rows 1 --fp8 --mma 1 --block-n 16 32 64 --block-k 128 256 --stages 3 4 \
        --programs-per-sm 0 --prefetch 0      # the tensor-core form's tilings
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform

import torch
import torch.nn.functional as F

from bench_env import commit, version, REPO
from bench_page_size import graph_time_us
from decode_measures import copy_bandwidth_gbps
from mstar.kernels.projection import gemv
from mstar.kernels.activation import silu_and_mul_triton
from mstar.kernels.norm import fused_add_rms_norm_triton
from mstar.kernels.quantize import quantize_rows_triton
from mstar.models.layers.fp8 import fp8_linear

LAYERS = 28
HIDDEN, INTER, QKV = 3072, 8192, 5120
EPS = 1e-5
# name: (K, weight rows, norm before, silu after)
SHAPES = {"qkv": (HIDDEN, QKV, True, False), "o": (HIDDEN, HIDDEN, False, False),
          "gate_up": (HIDDEN, 2 * INTER, True, True), "down": (INTER, HIDDEN, False, False)}
HEADS = {"head_window": 28736, "head_full": 156992}


GRID = {"block_n": (2, 4, 8), "block_k": None, "warps": (4, 8), "stages": (1,), "stats_block": (0,),
        "programs_per_sm": (0,), "prefetch": (0,), "mma": (0,)}


def sweep(rows: int, grid: dict, norm: bool) -> list[gemv.GemvConfig]:
    """Every tiling of the grid; the statistics' block only where a norm comes first (0: the tiling's block_k).
    Tensor-core tilings (`--mma 1`, float8 weights at one row) take blocks of 16 or more and neither
    programs_per_sm nor prefetch: the grid's values of those that do not apply are left out."""
    block_k = grid["block_k"] or ((512, 1024, 2048, 4096) if rows == 1 else (256, 512, 1024))
    stats = grid["stats_block"] if norm else (0,)
    out = []
    for n, kb, w, st, sb, p, pre, mma in itertools.product(grid["block_n"], block_k, grid["warps"], grid["stages"],
                                                           stats, grid["programs_per_sm"], grid["prefetch"],
                                                           grid["mma"]):
        if mma and (n < 16 or kb < 16 or p or pre):
            continue
        out.append(gemv.GemvConfig(n, kb, w, st, stats_block=sb, programs_per_sm=p, prefetch=bool(pre),
                                   mma=bool(mma)))
    return out


def weights(k: int, n: int, count: int, gen: torch.Generator, fp8: bool = False) -> list[torch.Tensor]:
    """`count` weights [n, k]; with `fp8` float8 rows, each with its scale in `SCALES`."""
    ws = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(count)]
    if not fp8:
        return ws
    quantized = []
    for w in ws:
        q, scale = quantize_rows_triton(w)
        SCALES[q.data_ptr()] = scale.reshape(-1)
        quantized.append(q)
    return quantized


SCALES: dict[int, torch.Tensor] = {}  # a float8 weight's row scales, by its storage


def scale_of(w: torch.Tensor) -> torch.Tensor | None:
    return SCALES.get(w.data_ptr()) if w.element_size() == 1 else None


class Shape:
    """One projection of every layer, with its inputs at `rows` rows."""

    def __init__(self, name: str, rows: int, ws: list[torch.Tensor], gen: torch.Generator) -> None:
        k, _n, self.norm, self.silu = SHAPES.get(name, (HIDDEN, 0, False, False))
        self.ws = ws
        self.x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        self.r = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        self.nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)

    def cublas(self, i: int) -> torch.Tensor:
        x = fused_add_rms_norm_triton(self.x, self.r, self.nw, EPS)[0] if self.norm else self.x
        w = self.ws[i % len(self.ws)]
        scale = scale_of(w)
        y = F.linear(x, w) if scale is None else fp8_linear(x, w, scale, None, x.shape[0])
        return silu_and_mul_triton(y) if self.silu else y

    def fused(self, i: int, cfg: gemv.GemvConfig | None) -> torch.Tensor:
        w = self.ws[i % len(self.ws)]
        if self.norm:
            return gemv.norm_linear(self.x, self.r, self.nw, EPS, w, silu=self.silu, config=cfg,
                                    weight_scale=scale_of(w))[0]
        return gemv.linear(self.x, w, cfg, weight_scale=scale_of(w))

    def error(self, cfg: gemv.GemvConfig | None) -> float:
        """Largest difference from the cuBLAS path, in units of the output's largest magnitude."""
        ref = self.cublas(0).float()
        return ((self.fused(0, cfg).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def default_config(rows: int, shape: Shape, half: bool = True) -> gemv.GemvConfig:
    """`config_for`'s tiling; `half` False: as for rows of float32, which the tensor cores do not take."""
    w = shape.ws[0]
    return gemv.config_for(rows, w.shape[0] // (2 if shape.silu else 1), w.shape[1], shape.norm, shape.silu,
                           w.element_size() == 1, half=half)  # the benchmark's rows are bf16


def per_shape(rows: list[int], all_weights: dict[str, list[torch.Tensor]], gen: torch.Generator,
              grid: dict) -> dict:
    out: dict = {}
    for m in rows:
        for name, ws in all_weights.items():
            shape = Shape(name, m, ws, gen)
            calls = len(ws)
            base = graph_time_us(shape.cublas, calls=calls, replays=10)
            results = []
            for cfg in sweep(m, grid, shape.norm):
                try:
                    us = graph_time_us(lambda i, c=cfg: shape.fused(i, c), calls=calls, replays=10)
                except Exception as e:  # a tiling the compiler refuses (registers): skip it, say so
                    print(f"  rows {m} {name} {cfg}: {type(e).__name__}", flush=True)
                    continue
                results.append((us, cfg))
            results.sort(key=lambda t: t[0])
            best_us, best = results[0]
            default = default_config(m, shape)
            default_us = graph_time_us(lambda i: shape.fused(i, default), calls=calls, replays=10)
            plain = dataclasses.replace(default, pdl=False)
            plain_us = graph_time_us(lambda i: shape.fused(i, plain), calls=calls, replays=10)
            nbytes = ws[0].numel() * ws[0].element_size()
            out[f"{m}/{name}"] = {"rows": m, "shape": name, "cublas_us": round(base, 2), "best_us": round(best_us, 2),
                                  "best": best.__dict__, "default_us": round(default_us, 2),
                                  "default": default.__dict__, "plain_us": round(plain_us, 2),
                                  "error": shape.error(best),
                                  "weight_MB": round(nbytes / 1e6, 1),
                                  "best_GBps": round(nbytes / best_us / 1e3, 1),
                                  "cublas_GBps": round(nbytes / base / 1e3, 1),
                                  "top5": [(round(u, 2), c.__dict__) for u, c in results[:5]]}
            r = out[f"{m}/{name}"]
            print(f"rows {m:>2} {name:>12}: cuBLAS {base:8.2f} us ({r['cublas_GBps']:7.1f} GB/s)  "
                  f"gemv best {best_us:8.2f} us ({r['best_GBps']:7.1f} GB/s) {best}  default {default_us:8.2f} us "
                  f"({plain_us:8.2f} without dependent launch)  "
                  f"err {r['error']:.2e}", flush=True)
    return out


def step(rows: list[int], layer_weights: dict[str, list[torch.Tensor]], best: dict, gen: torch.Generator,
         gbps: float) -> dict:
    """A 28-layer step's projections, norms and activation: cuBLAS with the separate kernels, or the gemv
    kernels (the tilings found best, and the defaults)."""
    out = {}
    floor_ms = sum(ws[0].numel() * ws[0].element_size() for ws in layer_weights.values()) * LAYERS / gbps / 1e6
    for m in rows:
        shapes = {name: Shape(name, m, ws, gen) for name, ws in layer_weights.items()}

        plain = {name: dataclasses.replace(default_config(m, s), pdl=False) for name, s in shapes.items()}
        # the default tilings as CUDA cores alone would take them (float8: no tensor-core form)
        cores = {name: default_config(m, s, half=False) for name, s in shapes.items()}

        def run(i: int, how: str) -> None:
            for name, s in shapes.items():
                found = best[f"{m}/{name}"]
                if how == "cublas" or (how == "fastest" and found["cublas_us"] <= found["best_us"]):
                    s.cublas(i)
                else:
                    s.fused(i, {"default": None, "plain": plain[name], "cores": cores[name]}.get(
                        how, gemv.GemvConfig(**found["best"])))
        # "plain": the default tiling launched without programmatic dependent launch
        times = {how: graph_time_us(lambda i, h=how: run(i, h), calls=LAYERS, replays=10) * LAYERS / 1e3
                 for how in ("cublas", "best", "default", "plain", "cores", "fastest")}
        out[m] = {k: round(v, 3) for k, v in times.items()} | {"floor_ms": round(floor_ms, 3)}
        print(f"rows {m}: a step's projections: cuBLAS {times['cublas']:.3f} ms, gemv best {times['best']:.3f}, "
              f"gemv default {times['default']:.3f} ({times['plain']:.3f} without dependent launch, "
              f"{times['cores']:.3f} on CUDA cores alone), each projection the faster way {times['fastest']:.3f}; "
              f"the weights' floor {floor_ms:.3f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=None)
    for name, default in GRID.items():  # the sweep's tilings: every combination of these
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=default,
                        help=f"the sweep's {name} values (default {default or 'by rows'})")
    ap.add_argument("--shapes", nargs="+", default=None, help="only these projections (default all)")
    ap.add_argument("--fp8", action="store_true", help="the layers' weights as float8 rows (no heads)")
    args = ap.parse_args()
    grid = {name: getattr(args, name) for name in GRID}
    gen = torch.Generator(device="cuda").manual_seed(0)
    gbps = copy_bandwidth_gbps(torch.device("cuda"))
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": version("triton"),
           "python": platform.python_version(), "commit": commit(REPO), "copy_GBps": round(gbps, 1),
           "weights": "fp8" if args.fp8 else "bf16"}
    print(env, flush=True)
    layer_weights = {name: weights(k, n, LAYERS, gen, args.fp8) for name, (k, n, _, _) in SHAPES.items()}
    heads = {} if args.fp8 else {name: weights(HIDDEN, n, 1, gen) for name, n in HEADS.items()}
    measured = {name: ws for name, ws in (layer_weights | heads).items() if not args.shapes or name in args.shapes}
    shapes = per_shape(args.rows, measured, gen, grid)
    result = {"env": env, "shapes": shapes}
    if not set(layer_weights) - set(measured):  # a step needs every layer projection's best tiling
        result["step"] = step(args.rows, layer_weights, shapes, gen, gbps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
