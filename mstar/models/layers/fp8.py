"""fp8 (e4m3) projections, `--quantization fp8`: a `Linear`'s weight [out, in]
stored as float8 with one float32 scale per output row, each activation row
quantized as it comes (its own scale), and their product accumulated in
float32 and written in the activations' dtype.

At hundreds of decode rows an Orpheus-3B step's projections stop being
bound by reading the weights and become bound by the tensor cores' bf16
arithmetic (3.4 ms a step at 400 rows on an H200, at ~750 TFLOP/s:
`docs/benchmarks/analysis.md`); fp8 doubles that arithmetic rate and halves
the weight bytes. The output changes (it is opt-in): per-row scales keep the
error of each product near e4m3's 2^-4 relative step.

On CUDA the rows are quantized by one kernel (`kernels/quantize.py`) and the
product is `torch._scaled_mm` with row-wise scales (Ada, Hopper and later);
one row (a lone decode step, where a projection only streams its weight)
takes the one-row kernels (`kernels/projection/`) instead, weight-only: the
row is not quantized (there that costs more than the weight's stream), so a
lone row's product is a little nearer the bf16 one than a batch's.
Elsewhere the reference dequantizes both sides and multiplies in float32,
the same arithmetic up to summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.quantize import FP8, quantize_rows_reference, quantize_rows_triton

ALIGN = 16        # fp8 GEMMs want both of the weight's dimensions a multiple of this


CHUNK_ROWS = 4096  # a weight is quantized this many rows at a time: float32 copies of a whole one are GBs


def can_quantize(linear: nn.Module) -> bool:
    w = getattr(linear, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype != FP8 and w.shape[0] % ALIGN == 0
            and w.shape[1] % ALIGN == 0)


def quantize_weight(linear: nn.Module) -> None:
    """Turn `linear`'s weight into float8 rows and their scales, in place
    (`weight_scale` [out] float32); its forward then takes `fp8_linear`."""
    w = linear.weight.data
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], CHUNK_ROWS):   # once, at load: the reference is exact
        rows = slice(start, start + CHUNK_ROWS)
        q[rows], chunk_scale = quantize_rows_reference(w[rows])
        scale[rows] = chunk_scale.reshape(-1)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.register_buffer("weight_scale", scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K].T (+ bias) in x's dtype (bf16
    on CUDA). `rows`: on CUDA the GEMM runs at this many rows (at least x's;
    rounded up to a multiple of 16), the padding quantized as zeros."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"fp8 projections on CUDA take bfloat16 activations, not {x.dtype}")
        padded = -(-max(rows or m, m, 1) // ALIGN) * ALIGN
        q, scale = quantize_rows_triton(x2, padded)   # the padding rows by the quantizing kernel itself
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, -1),
                               out_dtype=torch.bfloat16)[:m]
    else:
        q, scale = quantize_rows_reference(x2)
        out = ((q.float() * scale) @ (weight.float() * weight_scale[:, None]).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])
