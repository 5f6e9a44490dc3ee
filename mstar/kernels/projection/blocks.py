"""The blocks both projection kernels (`gemv.py` on CUDA cores, `gemv_mma.py`
on tensor cores) share: a block of the weight's rows as stored, a block of
the rows the weight multiplies (x, or x plus the residual, normed, rounded
where torch rounds), and a block of outputs stored (float8 rows' scales,
SiLU-and-multiply, the output dtype).
"""

from __future__ import annotations

from mstar.kernels.backend import jit, tl


@jit
def weight_block(w_ptr, stride_w, up_offset, cols, kk, w_mask, SILU: tl.constexpr):
    """A block of the weight's rows `cols` (and of their up half's), as stored."""
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    wu = w
    if SILU:
        wu = tl.load(w_rows + up_offset + kk[None, :], mask=w_mask, other=0.0)
    return w, wu


@jit
def input_block(x_ptr, r_ptr, nw_ptr, rows, row_mask, stride_x, stride_r, kk, k_mask, inv, dtype: tl.constexpr,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, CENTERED: tl.constexpr):
    """A block of the rows the weight multiplies: x, or x (+ residual) normed, rounded where torch rounds."""
    mask = row_mask[:, None] & k_mask[None, :]
    xs = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        if RESIDUAL:
            rs = tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0).to(tl.float32)
            xs = (xs + rs).to(dtype).to(tl.float32)
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        if CENTERED:
            xs = (xs * inv[:, None] * (1.0 + nw[None, :])).to(dtype).to(tl.float32)
        else:
            xs = ((xs * inv[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype).to(tl.float32)
    return xs


@jit
def store_block(out_ptr, acc, acc_up, rows, row_mask, cols, col_mask, stride_out, ws_ptr, up_rows,
                dtype: tl.constexpr, SILU: tl.constexpr, FP8: tl.constexpr):
    """A block of columns' outputs: the products, or silu(gate) * up, rounded where torch rounds; with FP8 the
    sums times their float8 weight rows' scales first."""
    if FP8:
        acc = acc * tl.load(ws_ptr + cols, mask=col_mask, other=0.0)[None, :]
        if SILU:
            acc_up = acc_up * tl.load(ws_ptr + up_rows + cols, mask=col_mask, other=0.0)[None, :]
    y = acc
    if SILU:
        gate = y.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        y = act * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(dtype),
             mask=row_mask[:, None] & col_mask[None, :])
