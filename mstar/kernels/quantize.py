"""Row quantization to fp8 for `--quantization fp8`: activations x [M, K]
in, (float8 e4m3 [M, K], float32 scales [M, 1]) out, with x ~= q * scale
and each row's largest magnitude at e4m3's largest value, 448.

The torch form is five passes over x (abs, amax, a float copy, the division
with its clamp, the cast) and five launches, before each of a decoder
layer's four projections: at 400 rows about 1.5 ms a step of an Orpheus-3B
decode, most of what fp8 GEMMs save. Here one program reads its row once
and writes it once.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0   # e4m3fn's largest finite value
MIN_AMAX = 1e-12  # an all-zero row gets this, not a zero scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # times the reciprocal, not divided: torch's CUDA division by a scalar multiplies by its reciprocal and the
    # CPU's divides, so only the product is one definition on both (and the kernel's)
    scale = torch.clamp(amax, min=MIN_AMAX) * (1.0 / FP8_MAX)
    q = torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_rows_triton(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows`: at least x's; the rows past x's come out as zeros with scale
    1 (a GEMM's padding)."""
    if x.dim() != 2 or (rows is not None and rows < x.shape[0]):
        raise ValueError(f"quantize_rows takes [M, K] and at least M rows, got {tuple(x.shape)} and {rows}")
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = rows or m
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows and k:
        block = block_size(k)
        _quantize_rows_kernel[(rows,)](x, x.stride(0), q, scale, m, k, FP8_MAX, 1.0 / FP8_MAX, MIN_AMAX, BLOCK=block,
                                       num_warps=num_warps(block))
    return q, scale


@jit(any_value=("m",))
def _quantize_rows_kernel(x_ptr, stride, q_ptr, scale_ptr, m, k, fp8_max, inv_max, min_amax, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < k
    x = tl.load(x_ptr + row * stride + cols, mask=mask & (row < m), other=0.0).to(tl.float32)   # padding: 0
    # a padding row (all zeros) gets scale 1, as the torch form pads
    scale = tl.where(row < m, tl.maximum(tl.max(tl.abs(x), axis=0), min_amax) * inv_max, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)   # rounded as torch's division
    tl.store(q_ptr + row * k + cols, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(scale_ptr + row, scale)
