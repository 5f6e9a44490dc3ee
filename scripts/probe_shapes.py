"""Host time of a GEMM, a convolution and windowed attention at shapes the
process has not seen before, against the same shapes again: what an eager
prefill pays when its token count is new. Prints microseconds per call.

    python scripts/probe_shapes.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _host_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    us = 1e6 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return us


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda,
          "cudnn", torch.backends.cudnn.version(), "CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING"))
    w = torch.randn(5120, 2048, device=dev, dtype=dt)
    w2 = torch.randn(2048, 4096, device=dev, dtype=dt)
    x = torch.randn(4096, 4096, device=dev, dtype=dt)
    F.linear(x[:64, :2048], w)
    for m in (37, 291, 333, 517, 1029, 1500):
        a = x[:m, :2048]
        print(f"linear M={m:5d}: first {_host_us(lambda: F.linear(a, w)):8.0f} us, again "
              f"{_host_us(lambda: F.linear(a, w)):6.0f} us; other weight first "
              f"{_host_us(lambda: F.linear(x[:m], w2)):8.0f} us")
    bucket_first = [_host_us(lambda: F.linear(x[:m, :2048], w)) for m in range(1024, 1056)]
    print("linear M=1024..1055 first calls (us):", " ".join(f"{u:.0f}" for u in bucket_first))
    # a known shape's host time, median of 50 calls, under each BLAS library torch can call
    for library in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(library)
        a = x[:320, :2048]
        F.linear(a, w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):  # back to back, as a step launches them
            F.linear(a, w)
        per_call = 1e6 * (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        new_m = [_host_us(lambda m=m: F.linear(x[:m, :2048], w)) for m in range(2000, 2010)]
        print(f"{library:9}: known shape {per_call:6.1f} us a call back to back; new row counts (us): "
              + " ".join(f"{u:.0f}" for u in new_m))
    torch.backends.cuda.preferred_blas_library("cublaslt")
    conv = torch.nn.Conv2d(1, 480, 3, 2, padding=1, device=dev, dtype=dt)
    conv2 = torch.nn.Conv2d(480, 480, 3, 2, padding=1, device=dev, dtype=dt)
    for c in (40, 41, 48, 40):
        inp = torch.randn(c, 1, 128, 100, device=dev, dtype=dt)
        print(f"conv chunks={c}: {_host_us(lambda: conv2(F.gelu(conv(inp)))):8.0f} us")
    for windows in (40, 41, 40):
        q = torch.randn(windows, 20, 104, 64, device=dev, dtype=dt)
        mask = torch.ones(windows, 1, 1, 104, dtype=torch.bool, device=dev)
        for name, backends in (("default", None), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                               ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
            def run():
                if backends is None:
                    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            try:
                print(f"sdpa windows={windows} {name:9}: first {_host_us(run):8.0f} us, again {_host_us(run):6.0f} us")
            except RuntimeError as e:
                print(f"sdpa {name}: {str(e)[:80]}")


if __name__ == "__main__":
    main()
