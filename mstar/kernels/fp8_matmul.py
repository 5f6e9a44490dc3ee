"""Activations times float8 weights, `--quantization fp8`: x [M, K] (bf16
on CUDA), a weight [N, K] in float8 e4m3 with one float32 scale per output
row, out [M, N] = (x @ weight.T) * scale in x's dtype, accumulated in float32.

The activations stay in their dtype: only the weights are rounded (once, at
load), so the error is the weights' alone. Each float8 weight is exactly a bf16 value, so
a program widens its tile of weights in registers and multiplies on the
bf16 tensor cores; the weight bytes a step reads, the whole cost of a
decode step's projections at tens of rows, are halved.

Tiles are fixed per row count (`TABLE`), not autotuned, so a launch is the
same every time and can be captured in a CUDA graph. At a few rows every
program streams a narrow band of weight rows; the band narrows further on
narrow outputs so the grid still covers the GPU's SMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.kernels.backend import jit, tl, use_triton

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Tiles:
    """Rows and output columns a program covers, the reduction depth per
    step, warps and software-pipeline stages."""
    m: int
    n: int
    k: int
    warps: int
    stages: int


# (most rows, tiles), the first match wins
TABLE: tuple[tuple[int, Tiles], ...] = (
    (16, Tiles(16, 32, 256, 4, 4)),
    (32, Tiles(32, 32, 256, 4, 4)),
    (64, Tiles(64, 64, 128, 4, 4)),
    (128, Tiles(64, 128, 128, 4, 4)),
    (1 << 62, Tiles(128, 128, 64, 8, 4)),
)
MIN_PROGRAMS = 256   # a narrow output's band is halved (down to 16 columns) until the grid has this many programs


def tiles_for(m: int, n: int) -> Tiles:
    t = next(t for most, t in TABLE if m <= most)
    block_n = t.n
    while block_n > 16 and _cdiv(m, t.m) * _cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return Tiles(t.m, block_n, t.k, t.warps, t.stages)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return fp8_matmul_triton(x, weight, scale)
    return fp8_matmul_reference(x, weight, scale)


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scale after the sum, as the kernel applies it."""
    return ((x.float() @ weight.float().t()) * scale.float()).to(x.dtype)


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      tiles: Tiles | None = None) -> torch.Tensor:
    """`tiles` overrides the table's choice (the tests and the benchmark's
    sweep reach other tiles this way)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if weight.dtype != FP8 or scale.shape != (weight.shape[0],):
        raise ValueError(f"weight must be {FP8} with one scale per row, got {weight.dtype} and {tuple(scale.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = tiles or tiles_for(m, n)
    interpreted = not x.is_cuda
    grid = (_cdiv(m, t.m) * _cdiv(n, t.n),)
    _fp8_matmul_kernel[grid](x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                             BLOCK_M=t.m, BLOCK_N=t.n, BLOCK_K=t.k, INTERPRETED=interpreted,
                             num_warps=t.warps, num_stages=t.stages)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@jit(any_value=("m",))
def _fp8_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, m, n, k, stride_x, stride_w, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    # row tiles vary fastest: the programs of one band of weight rows run
    # side by side and share its reads through L2
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(m, BLOCK_M)
    rows = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = ks < k - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERPRETED:  # the interpreter's dot would multiply bf16's raw bits
            a, w = a.to(tl.float32), w.to(tl.float32)
        else:
            w = w.to(a.dtype)   # exact: every e4m3 value is a bf16 value
        acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
