"""The halves of a SNAC residual unit around its 1x1 convolution, each one
pass: activations [B, C, T] in and out.

A residual unit is snake, depthwise dilated conv (kernel 7), snake, 1x1
conv, plus its input. Fused into one pass with the conv, the first snake is
computed once per tap (seven sines an output); and the 1x1 conv, run as a
convolution, costs two layout transposes beside its GEMM. Here the unit runs
as three launches, one sine per value:

- `dwconv_snake`: the depthwise conv over an input that is already the
  first snake's output, then bias and the second snake;
- the 1x1 conv as a batched GEMM (the caller's `torch.bmm`);
- `residual_snake`: the input plus the GEMM's output (times the noise where
  the unit is a noise injection) plus the bias, and the next snake of that
  sum, which is what the next unit (or the next block's transposed conv, or
  the decoder's last conv) reads.

Both compute in float32 and round once; their torch references (CPU) do the
same ops in the activations' dtype. A program covers `TILE` values: rows of
(batch, channel) by a block of columns no wider than the rows are, since a
deep block's rows (its played span) are a few dozen samples long.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import jit, num_warps, row_tiles, tl, use_triton
from mstar.kernels.codec.snake import ALPHA_EPS, conv_window, depthwise_call, snake_reference

TILE = 1024  # values a program covers


def dwconv_snake(sx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor,
                 dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    """snake(conv1d(sx, weight, bias, groups=C, dilation, length kept, zeros
    beyond sx's ends), alpha), outputs [offset, offset + width) only:
    [B, C, width]."""
    if use_triton(sx) and not torch.is_grad_enabled():
        return dwconv_snake_triton(sx, weight, bias, alpha, dilation, offset, width)
    return dwconv_snake_reference(sx, weight, bias, alpha, dilation, offset, width)


def dwconv_snake_reference(sx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor,
                           dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    return snake_reference(conv_window(sx, weight, bias, dilation, sx.shape[1], offset, width), alpha)


def dwconv_snake_triton(sx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor,
                        dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    batch, channels, length, width, taps, b = depthwise_call("dwconv_snake", sx, weight, bias, alpha, offset, width)
    sx = sx.contiguous()
    out = torch.empty(batch, channels, width, dtype=sx.dtype, device=sx.device)
    if out.numel():
        per, block, grid = row_tiles(batch * channels, width, TILE)
        _dwconv_snake_kernel[grid](sx, weight.reshape(channels, taps).contiguous(), b.contiguous(),
                                   alpha.reshape(-1).contiguous(), out, batch * channels, channels, length, offset,
                                   width, dilation, ALPHA_EPS, TAPS=taps, ROWS=per, BLOCK=block,
                                   num_warps=num_warps(TILE))
    return out


@jit
def _dwconv_snake_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, out_ptr, n_rows, channels, length, offset, width, dilation,
                         eps, TAPS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS (batch, channel) rows: `length` samples in, `width` out
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    c = rows % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    out_ok = live[:, None] & (cols < width)[None, :]
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32) + tl.load(b_ptr + c, mask=live, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(TAPS):
        src = offset + cols + (k - (TAPS - 1) // 2) * dilation
        valid = out_ok & ((src >= 0) & (src < length))[None, :]
        xv = tl.load(x_ptr + rows[:, None] * length + src[None, :], mask=valid, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + c * TAPS + k, mask=live, other=0.0).to(tl.float32)[:, None] * xv
    a = tl.load(alpha_ptr + c, mask=live, other=1.0).to(tl.float32)[:, None]
    s = tl.sin(a * acc)
    tl.store(out_ptr + rows[:, None] * width + cols[None, :], (acc + s * s / (a + eps)).to(out_ptr.dtype.element_ty),
             mask=out_ok)


def residual_snake(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor | None,
                   noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out = x + y (* noise [B, 1, T]) + bias [C], and snake(out, alpha)
    (None without alpha). x may be a view of a longer signal (its last dim
    contiguous); y [B, C, T] contiguous."""
    if use_triton(x) and not torch.is_grad_enabled():
        return residual_snake_triton(x, y, bias, alpha, noise)
    return residual_snake_reference(x, y, bias, alpha, noise)


def residual_snake_reference(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                             alpha: torch.Tensor | None,
                             noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = y * noise if noise is not None else y.clone()
    if bias is not None:
        out += bias[None, :, None]
    out += x
    return out, None if alpha is None else snake_reference(out, alpha)


def residual_snake_triton(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor | None,
                          noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, channels, length = y.shape
    if x.shape != y.shape or x.stride(-1) != 1 or (noise is not None and noise.shape != (batch, 1, length)):
        raise ValueError(f"residual_snake takes x and y [B, C, T] (x's last dim contiguous) and noise [B, 1, T], "
                         f"got {tuple(x.shape)} (strides {x.stride()}), {tuple(y.shape)} and "
                         f"{None if noise is None else tuple(noise.shape)}")
    y = y.contiguous()
    out = torch.empty_like(y)
    snaked = torch.empty_like(y) if alpha is not None else out
    if out.numel():
        per, block, grid = row_tiles(batch * channels, length, TILE)
        _residual_snake_kernel[grid](x, x.stride(0), x.stride(1), y, bias if bias is not None else y,
                                     noise.contiguous() if noise is not None else y,
                                     alpha.reshape(-1).contiguous() if alpha is not None else y, out, snaked,
                                     batch * channels, channels, length, ALPHA_EPS, HAS_BIAS=bias is not None,
                                     HAS_NOISE=noise is not None, SNAKE=alpha is not None, ROWS=per, BLOCK=block,
                                     num_warps=num_warps(TILE))
    return out, snaked if alpha is not None else None


@jit
def _residual_snake_kernel(x_ptr, x_batch_stride, x_channel_stride, y_ptr, b_ptr, noise_ptr, alpha_ptr, out_ptr,
                           snaked_ptr, n_rows, channels, length, eps, HAS_BIAS: tl.constexpr, HAS_NOISE: tl.constexpr,
                           SNAKE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # (batch, channel) rows
    live = rows < n_rows
    b = rows // channels
    c = rows % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = live[:, None] & (cols < length)[None, :]
    at = rows[:, None] * length + cols[None, :]
    y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        y = y * tl.load(noise_ptr + b[:, None] * length + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + c, mask=live, other=0.0).to(tl.float32)[:, None]
    x = tl.load(x_ptr + (b * x_batch_stride + c * x_channel_stride)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    out = x + y
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
    if SNAKE:
        a = tl.load(alpha_ptr + c, mask=live, other=1.0).to(tl.float32)[:, None]
        s = tl.sin(a * out)
        tl.store(snaked_ptr + at, (out + s * s / (a + eps)).to(snaked_ptr.dtype.element_ty), mask=mask)
