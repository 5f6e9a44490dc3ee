"""One row's projection over float8 weight rows with its products on the
tensor cores: x [1, K] (optionally RMSNormed first, after a residual add)
and a float8 weight [N, K] with a float32 scale per row in, x @ weight.T
[1, N] (or silu(gate) * up of a merged gate/up weight) out, in x's dtype.
`gemv.py` launches it for a tiling with `mma` set.

The CUDA-core kernel (`gemv.py`) turns every float8 weight element into
float32 before its product, which sets its pace at about twice its bytes'
floor. Here a program takes a block of weight rows [BLOCK_N, BLOCK_K] as
float16 (one conversion instruction per two elements on Hopper) and
multiplies it by the row repeated as the sixteen columns a tensor-core
product needs at the least; the products are exact in float32 and sum
there, as the CUDA-core kernel's do.

The row goes in as float16. A bfloat16 value converts exactly within
float16's range, so the product is the weight-only reference's
(`gemv.weight_only_reference`) up to the order of its sums. Out of range
is kept out by scaling: each program first bounds the row's magnitude (its
largest element; through the norm, the largest of its elements each times
its norm weight, times the row's inverse RMS), takes the row times the power
of two that brings that bound to 2**13-2**14, and the sums times its
inverse: exact both ways, and a row of small values keeps its bits clear of
float16's subnormals (but for elements some 2**27 under the row's largest,
whose share of a sum is below float32's resolution anyway).
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import cdiv, jit, tl
from mstar.kernels.projection.blocks import input_block, store_block, weight_block

MMA_COLUMNS = 16  # the row repeated: a tensor-core product takes no narrower side
RANGE_LOG2 = 14   # the row's bound in float16 after scaling (its largest finite value is ~2**16)
SHIFT_MIN = 126   # the most a row is scaled up (2**126): the factor and its inverse are normal float32
MMA_DTYPES = (torch.bfloat16, torch.float16)


def launch(x: torch.Tensor, res: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, centered: bool,
           weight: torch.Tensor, weight_scale: torch.Tensor, silu: bool, out: torch.Tensor, stream: torch.Tensor,
           block_n: int, block_k: int, stats_block: int, num_warps: int, num_stages: int, pdl: bool) -> None:
    """Fill `out` (and, after a residual add, `stream`) for one row; the
    caller (`gemv._launch`) has checked the shapes, and `GemvConfig` the
    blocks (16 or more)."""
    if x.shape[0] != 1 or x.dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes one row of {MMA_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    n, k = out.shape[1], x.shape[1]
    norm = norm_weight is not None
    _gemv_mma_kernel[(cdiv(n, block_n),)](
        x, res if res is not None else x, norm_weight if norm else x, weight, weight_scale, out, stream,
        n, k, weight.stride(0), n if silu else 0, eps,
        NORM=norm, RESIDUAL=res is not None, CENTERED=centered, SILU=silu, BLOCK_N=block_n, BLOCK_K=block_k,
        STATS_BLOCK=stats_block, COLUMNS=MMA_COLUMNS, RANGE=RANGE_LOG2, SHIFT_MIN=SHIFT_MIN, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}))


@jit
def _row_bound(x_ptr, r_ptr, nw_ptr, stream_ptr, k, eps, pid, dtype: tl.constexpr, NORM: tl.constexpr,
               RESIDUAL: tl.constexpr, CENTERED: tl.constexpr, STATS_BLOCK: tl.constexpr):
    """The row's inverse RMS (1 without the norm) and a bound on the
    magnitude of what the weight multiplies. After a residual add the first
    program writes the stream (the sum) as it goes."""
    offs = tl.arange(0, STATS_BLOCK)
    sq = tl.zeros([STATS_BLOCK], dtype=tl.float32)
    top = tl.zeros([STATS_BLOCK], dtype=tl.float32)
    for k0 in range(0, k, STATS_BLOCK):
        kk = k0 + offs
        mask = kk < k
        xs = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            summed = (xs + tl.load(r_ptr + kk, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(stream_ptr + kk, summed, mask=mask & (pid == 0))
            xs = summed.to(tl.float32)
        if NORM:
            sq += xs * xs
            nw = tl.load(nw_ptr + kk, mask=mask, other=0.0).to(tl.float32)
            xs = xs * (1.0 + nw if CENTERED else nw)  # each element times its own gain: the bound stays tight
        top = tl.maximum(top, tl.abs(xs))
    inv = 1.0
    bound = tl.max(top, axis=0)
    if NORM:
        inv = tl.rsqrt(tl.sum(sq, axis=0) / k + eps)
        bound = bound * inv
    return inv, bound


@jit
def _products(acc, acc_up, w, wu, x_ptr, r_ptr, nw_ptr, kk, k_mask, inv_row, down, dtype: tl.constexpr,
              NORM: tl.constexpr, RESIDUAL: tl.constexpr, CENTERED: tl.constexpr, SILU: tl.constexpr,
              BLOCK_K: tl.constexpr, COLUMNS: tl.constexpr):
    """The accumulators with a K block's products added: the weight block as float16 times the row's block,
    scaled into float16 and repeated as the product's columns."""
    one = tl.arange(0, 1)
    xs = input_block(x_ptr, r_ptr, nw_ptr, one, one < 1, 0, 0, kk, k_mask, inv_row, dtype, NORM, RESIDUAL,
                     CENTERED)
    row = tl.broadcast_to(tl.trans(xs * down).to(tl.float16), (BLOCK_K, COLUMNS))
    acc = tl.dot(w.to(tl.float16), row, acc)
    if SILU:
        acc_up = tl.dot(wu.to(tl.float16), row, acc_up)
    return acc, acc_up


@jit
def _gemv_mma_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, ws_ptr, out_ptr, stream_ptr, n, k, stride_w, up_rows, eps,
                     NORM: tl.constexpr, RESIDUAL: tl.constexpr, CENTERED: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_BLOCK: tl.constexpr,
                     COLUMNS: tl.constexpr, RANGE: tl.constexpr, SHIFT_MIN: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    up_offset = up_rows.to(tl.int64) * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    # the weight's first K block ahead of the row's pass: under PDL it loads while the kernel before ends (the
    # weight is never that kernel's output; x and the residual are, read after the wait)
    w, wu = weight_block(w_ptr, stride_w, up_offset, cols, offs_k, col_mask[:, None] & (offs_k < k)[None, :], SILU)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv, bound = _row_bound(x_ptr, r_ptr, nw_ptr, stream_ptr, k, eps, pid, dtype, NORM, RESIDUAL, CENTERED,
                            STATS_BLOCK)
    inv_row = tl.zeros([1], dtype=tl.float32) + inv
    # a power of two that brings the bound to 2**13-2**14, 4x under float16's largest (room for the approximate
    # log2 and the roundings of the normed values): the row's float16 form stays exact (a small row's too, clear of
    # float16's subnormals), and so do the sums brought back; a row of zeros (log2: -inf) takes the largest
    # factor, harmlessly, and a row holding an inf none (its products are then the reference's infs, not inf * 0)
    shift = tl.where(bound < float("inf"), tl.maximum(tl.ceil(tl.log2(bound)) - RANGE, -SHIFT_MIN), 0.0)
    down = tl.exp2(-shift)
    acc = tl.zeros([BLOCK_N, COLUMNS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, COLUMNS], dtype=tl.float32)
    acc, acc_up = _products(acc, acc_up, w, wu, x_ptr, r_ptr, nw_ptr, offs_k, offs_k < k, inv_row, down, dtype,
                            NORM, RESIDUAL, CENTERED, SILU, BLOCK_K, COLUMNS)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k
        # names of the loop's own: the first block's are no loop-carried values
        w_k, wu_k = weight_block(w_ptr, stride_w, up_offset, cols, kk, col_mask[:, None] & k_mask[None, :], SILU)
        acc, acc_up = _products(acc, acc_up, w_k, wu_k, x_ptr, r_ptr, nw_ptr, kk, k_mask, inv_row, down, dtype,
                                NORM, RESIDUAL, CENTERED, SILU, BLOCK_K, COLUMNS)
    # every column of the products is the row's: keep the first, times the scaling's inverse
    first = tl.arange(0, COLUMNS)[None, :] == 0
    up = tl.exp2(shift)
    y = tl.sum(tl.where(first, acc, 0.0), axis=1) * up
    y_up = tl.sum(tl.where(first, acc_up, 0.0), axis=1) * up
    one = tl.arange(0, 1)
    store_block(out_ptr, y[None, :], y_up[None, :], one, one < 1, cols, col_mask, 0, ws_ptr, up_rows, dtype, SILU,
                True)
