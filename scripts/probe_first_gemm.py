"""What a GEMM of a row count the process has not run before costs the first
time, against the same GEMM again: cuBLAS picks its kernel by shape, and with
CUDA's lazy module loading (the default) a kernel's module loads on its
first launch. Orpheus-3B's projection shapes (bf16), M rows in the order
given, each timed once cold and once warm (a `torch.cuda.synchronize` around
each call). Run on the GPU machine:

    python scripts/probe_first_gemm.py --rows 40 64 416 830 2900 8192
"""

from __future__ import annotations

import argparse
import os
import time

import torch

# (N, K) of a Llama-3.2-3B layer's projections: qkv, o, gate/up, down
SHAPES = ((5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192))


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[40, 64, 416, 830, 2900, 8192])
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many of the four shapes")
    p.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                   help="torch.backends.cuda.preferred_blas_library")
    a = p.parse_args()
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    dev = torch.device("cuda:0")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in SHAPES[:a.shapes]]
    print(f"# {torch.cuda.get_device_name(dev)} | torch {torch.__version__} | "
          f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')} | "
          f"blas {torch.backends.cuda.preferred_blas_library()}")
    print(f"{'rows':>6} " + " ".join(f"{f'{n}x{k} cold/warm ms':>26}" for n, k in SHAPES[:a.shapes]))
    for m in a.rows:
        cells = []
        for w in weights:
            x = torch.randn(m, w.shape[1], device=dev, dtype=torch.bfloat16)
            cold = timed(lambda: x @ w.T)
            warm = timed(lambda: x @ w.T)
            cells.append(f"{cold:>12.3f} / {warm:<11.3f}")
        print(f"{m:>6} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
