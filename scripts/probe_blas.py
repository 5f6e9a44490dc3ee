"""Orpheus-3B's four layer projections as plain GEMMs (`F.linear`, bf16) at
the decode batch's row counts, under each BLAS library torch can prefer
(cuBLAS, cuBLASLt): which one reads the weights closer to the copy
bandwidth where the layers take a GEMM (more than one row). Every layer its
own weight (nothing read from L2 twice), times from CUDA graphs of the 28
layers' calls, as `bench_gemv.py` measures.

    python scripts/probe_blas.py --rows 16 64 128 256 --out $OUT/blas.json    # device tool, carry .wheels
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from bench_env import commit, REPO
from bench_gemv import LAYERS, SHAPES, weights
from bench_page_size import graph_time_us
from decode_measures import copy_bandwidth_gbps

LIBRARIES = ("cublas", "cublaslt")


def measure(rows: list[int], layer_weights: dict[str, list[torch.Tensor]], gen: torch.Generator) -> dict:
    out: dict = {}
    before = torch.backends.cuda.preferred_blas_library()
    try:
        for library in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(library)
            _measure_library(library, rows, layer_weights, gen, out)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return out


def _measure_library(library: str, rows: list[int], layer_weights: dict[str, list[torch.Tensor]],
                     gen: torch.Generator, out: dict) -> None:
    """Each row count's four projections under `library` (the preferred one now), into `out`."""
    for m in rows:
        total = 0.0
        for name, ws in layer_weights.items():
            x = torch.randn(m, ws[0].shape[1], device="cuda", generator=gen).to(torch.bfloat16)
            us = graph_time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i % len(ws)]), calls=len(ws), replays=10)
            nbytes = ws[0].numel() * ws[0].element_size()
            out[f"{library}/{m}/{name}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
            total += us * LAYERS / 1e3
            print(f"{library:>8} rows {m:>3} {name:>8}: {us:8.2f} us ({nbytes / us / 1e3:7.1f} GB/s)", flush=True)
        out[f"{library}/{m}/step_ms"] = round(total, 3)
        print(f"{library:>8} rows {m:>3}: a step's four projections x {LAYERS}: {total:.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gbps = copy_bandwidth_gbps(torch.device("cuda"))
    layer_weights = {name: weights(k, n, LAYERS, gen) for name, (k, n, _, _) in SHAPES.items()}
    floor_ms = sum(ws[0].numel() * ws[0].element_size() for ws in layer_weights.values()) * LAYERS / gbps / 1e6
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "commit": commit(REPO), "copy_GBps": round(gbps, 1), "floor_ms": round(floor_ms, 3)}
    print(env, flush=True)
    result = {"env": env, "results": measure(args.rows, layer_weights, gen)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
