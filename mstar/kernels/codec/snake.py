"""Snake, the periodic activation of SNAC's decoder: x [B, C, T] and a
per-channel alpha [1, C, 1] in, x + sin(alpha x)^2 / (alpha + eps) out, in
x's dtype. Also snake followed by the depthwise dilated convolution (kernel
7) that opens each of SNAC's residual units, in one pass; and SnakeBeta
(frequency and magnitude apart), Qwen3-Omni code2wav's activation, alone
or fused with what its causal convolutions read in a streaming step (the
held samples before it, the samples outside the sequence zeroed).

The torch expression is five passes over the activations (multiply, sine,
square, scale, add); at hundreds of codec windows per step those passes are
a large share of the GPU's time. The Triton kernel is one read and one write,
computing in float32 and rounding once, so in float16 it is closer to the
float32 result than the unfused expression, which rounds after every op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.kernels.backend import jit, num_warps, row_tiles, tl, use_triton

# the snac package's guard against alpha == 0; the reference keeps it so its bits match the package
ALPHA_EPS = 1e-9
BLOCK = 1024


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and not torch.is_grad_enabled():
        return snake_triton(x, alpha)
    return snake_reference(x, alpha)


def snake_reference(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The package's operations on the same operands (its TorchScript
    version runs them unfused on CPU), so the bits match; all but the first
    run in place on one temporary: at batch 16 a window's activations are
    tens of MB, and a fresh buffer per op costs page faults on CPU and
    memory on GPU."""
    if torch.is_grad_enabled():   # autograd needs the intermediates the in-place form overwrites
        return x + (alpha + ALPHA_EPS).reciprocal() * torch.sin(alpha * x).pow(2)
    out = torch.mul(alpha, x).sin_().pow_(2)
    return out.mul_((alpha + ALPHA_EPS).reciprocal()).add_(x)


def snake_triton(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return _launch(x, alpha, alpha, ALPHA_EPS, "snake")


def snake_beta(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float) -> torch.Tensor:
    """x + sin(freq x)^2 / (magnitude + eps), frequency and magnitude per
    channel ([1, C, 1]): the SnakeBeta of BigVGAN-style vocoders (Qwen3-Omni's
    code2wav), whose module keeps both as logs."""
    if (use_triton(x) and not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and freq.dtype == magnitude.dtype == x.dtype):  # else torch's promotion and precision
        return _launch(x, freq, magnitude, eps, "snake_beta")
    return snake_beta_reference(x, freq, magnitude, eps)


def snake_beta_reference(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float) -> torch.Tensor:
    return x + 1.0 / (magnitude + eps) * torch.sin(x * freq).pow(2)


def snake_beta_held(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float, held: torch.Tensor,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """What a causal convolution's streaming step reads: the samples it
    `held` [B, C, R] from the step before, then SnakeBeta of the new `x`
    [B, C, T], zeroed where `keep` [B, T] (bool) is False -> [B, C, R + T].
    One pass where the unfused form is four (activation, mask, its
    negation, concatenation)."""
    if (use_triton(x) and not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and freq.dtype == magnitude.dtype == held.dtype == x.dtype):
        return _launch_held(x, freq, magnitude, eps, held, keep)
    return snake_beta_held_reference(x, freq, magnitude, eps, held, keep)


def snake_beta_held_reference(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float,
                              held: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    y = snake_beta(x, freq, magnitude, eps)
    if keep is not None:
        y = y.masked_fill(~keep[:, None, :], 0.0)
    return torch.cat([held, y], dim=-1)


def _launch_held(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float, held: torch.Tensor,
                 keep: torch.Tensor | None) -> torch.Tensor:
    batch, channels, length = x.shape if x.dim() == 3 else (0, 0, 0)
    reach = held.shape[-1]
    if (x.dim() != 3 or held.dim() != 3 or held.shape[:2] != (batch, channels) or freq.numel() != channels
            or magnitude.numel() != channels
            or (keep is not None and (keep.shape != (batch, length) or keep.dtype != torch.bool))):
        raise ValueError(f"snake_beta_held takes x [B, C, T], held [B, C, R], per-channel parameters and keep "
                         f"[B, T] bool, got {tuple(x.shape)}, {tuple(held.shape)}, {tuple(freq.shape)} and "
                         f"{None if keep is None else (tuple(keep.shape), keep.dtype)}")
    x, held = x.contiguous(), held.contiguous()
    out = torch.empty(batch, channels, reach + length, dtype=x.dtype, device=x.device)
    if out.numel():
        # a bool tensor's bytes as uint8 (the same storage): what the kernel loads
        flags = keep.contiguous().view(torch.uint8) if keep is not None else x
        grid = (batch * channels, (reach + length + BLOCK - 1) // BLOCK)
        _snake_held_kernel[grid](x, held, flags, freq.reshape(-1).contiguous(), magnitude.reshape(-1).contiguous(),
                                 out, channels, length, reach, eps, HAS_KEEP=keep is not None, BLOCK=BLOCK,
                                 num_warps=num_warps(BLOCK))
    return out


@jit
def _snake_held_kernel(x_ptr, held_ptr, keep_ptr, freq_ptr, mag_ptr, out_ptr, channels, length, reach, eps,
                       HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # one (batch, channel) row: R held samples, then T new ones
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    total = reach + length
    is_held = cols < reach
    is_new = (cols >= reach) & (cols < total)
    t = tl.where(is_new, cols - reach, 0)
    a = tl.load(freq_ptr + row % channels).to(tl.float32)
    m = tl.load(mag_ptr + row % channels).to(tl.float32)
    x = tl.load(x_ptr + row * length + t, mask=is_new, other=0.0).to(tl.float32)
    s = tl.sin(a * x)
    y = (x + s * s / (m + eps)).to(out_ptr.dtype.element_ty)   # rounded once, as snake_beta's kernel does
    if HAS_KEEP:
        kept = tl.load(keep_ptr + (row // channels) * length + t, mask=is_new, other=0)
        y = tl.where(kept != 0, y, 0.0).to(out_ptr.dtype.element_ty)
    h = tl.load(held_ptr + row * reach + tl.where(is_held, cols, 0), mask=is_held, other=0.0)
    tl.store(out_ptr + row * total + cols, tl.where(is_held, h, y), mask=cols < total)


def _launch(x: torch.Tensor, freq: torch.Tensor, magnitude: torch.Tensor, eps: float, name: str) -> torch.Tensor:
    if x.dim() != 3 or freq.numel() != x.shape[1] or magnitude.numel() != x.shape[1]:
        raise ValueError(f"{name} takes x [B, C, T] and per-channel parameters [1, C, 1], got {tuple(x.shape)}, "
                         f"{tuple(freq.shape)} and {tuple(magnitude.shape)}")
    x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty_like(x)
    if out.numel():
        per, block, grid = row_tiles(batch * channels, length, BLOCK)
        _snake_kernel[grid](x, freq.reshape(-1).contiguous(), magnitude.reshape(-1).contiguous(), out,
                            batch * channels, channels, length, eps, ROWS=per, BLOCK=block,
                            num_warps=num_warps(BLOCK))
    return out


@jit
def _snake_kernel(x_ptr, freq_ptr, mag_ptr, out_ptr, n_rows, channels, length, eps, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # (batch, channel) rows of T samples
    live = rows < n_rows
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = live[:, None] & (cols < length)[None, :]
    a = tl.load(freq_ptr + rows % channels, mask=live, other=1.0).to(tl.float32)[:, None]
    m = tl.load(mag_ptr + rows % channels, mask=live, other=1.0).to(tl.float32)[:, None]
    at = rows[:, None] * length + cols[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    s = tl.sin(a * x)
    y = x + s * s / (m + eps)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


def snake_dwconv(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    """conv1d(snake(x, alpha), weight, bias) with groups = channels, odd
    kernel, `dilation`, and the padding that keeps the length (zeros beyond
    x's ends); only outputs [offset, offset + width) of that convolution
    (default: all of them), as [B, C, width]."""
    if use_triton(x) and not torch.is_grad_enabled():
        return snake_dwconv_triton(x, alpha, weight, bias, dilation, offset, width)
    return snake_dwconv_reference(x, alpha, weight, bias, dilation, offset, width)


def snake_dwconv_reference(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    # snake(0) = 0, so the padding's zeros may go in before or after the snake
    return conv_window(snake_reference(x, alpha), weight, bias, dilation, x.shape[1], offset, width)


def conv_window(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, groups: int,
                offset: int = 0, width: int | None = None) -> torch.Tensor:
    """conv1d(x, weight, bias) with an odd kernel, `dilation`, `groups` and
    the padding that keeps the length (zeros beyond x's ends), outputs
    [offset, offset + width) only (default: all): [B, C_out, width]."""
    length = x.shape[-1]
    width = length - offset if width is None else width
    check_window(length, offset, width)
    if width == 0:
        return x.new_empty(x.shape[0], weight.shape[0], 0)
    reach = (weight.shape[-1] - 1) * dilation // 2
    lo, hi = max(0, offset - reach), min(length, offset + width + reach)
    left, right = lo - (offset - reach), (offset + width + reach) - hi
    inner = x[..., lo:hi]
    if left != right:
        inner, left = F.pad(inner, (left, right)), 0
    return F.conv1d(inner, weight, bias, padding=left, dilation=dilation, groups=groups)


def check_window(length: int, offset: int, width: int) -> None:
    """Outputs [offset, offset + width) must lie in a signal of `length`."""
    if offset < 0 or width < 0 or offset + width > length:
        raise ValueError(f"outputs [{offset}, {offset + width}) do not lie in a signal of {length}")


def depthwise_call(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: torch.Tensor,
                   offset: int, width: int | None) -> tuple[int, int, int, int, int, torch.Tensor]:
    """A fused snake + depthwise convolution's call, checked: x [B, C, L],
    weight [C, 1, odd k], alpha of C values, outputs [offset, offset +
    width). Returns B, C, L, width, k and the bias (zeros when None)."""
    batch, channels, length = x.shape
    width = length - offset if width is None else width
    check_window(length, offset, width)
    taps = weight.shape[-1]
    if weight.shape != (channels, 1, taps) or taps % 2 == 0 or alpha.numel() != channels:
        raise ValueError(f"{op} takes a depthwise weight [C, 1, odd k] and alpha [1, C, 1] for "
                         f"C = {channels}, got {tuple(weight.shape)} and {tuple(alpha.shape)}")
    b = bias if bias is not None else torch.zeros(channels, dtype=x.dtype, device=x.device)
    return batch, channels, length, width, taps, b


def snake_dwconv_triton(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        dilation: int, offset: int = 0, width: int | None = None) -> torch.Tensor:
    """One read of x per tap (from cache), one write: the snake's output and
    the convolution's input are never stored. Padding is zeros after the
    snake, which is what the padded convolution sees (snake(0) = 0 anyway)."""
    batch, channels, length, width, taps, b = depthwise_call("snake_dwconv", x, weight, bias, alpha, offset, width)
    x = x.contiguous()
    out = torch.empty(batch, channels, width, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (batch * channels, (width + BLOCK - 1) // BLOCK)
        _snake_dwconv_kernel[grid](x, alpha.reshape(-1).contiguous(), weight.reshape(channels, taps).contiguous(),
                                   b.contiguous(), out, channels, length, offset, width, dilation, ALPHA_EPS,
                                   TAPS=taps, BLOCK=BLOCK, num_warps=num_warps(BLOCK))
    return out


@jit
def _snake_dwconv_kernel(x_ptr, alpha_ptr, w_ptr, b_ptr, out_ptr, channels, length, offset, width, dilation, eps,
                         TAPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # one (batch, channel) row: `length` samples in, `width` out
    c = row % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(alpha_ptr + c).to(tl.float32)
    inv = 1.0 / (a + eps)
    acc = tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(b_ptr + c).to(tl.float32)
    for k in tl.static_range(TAPS):
        src = offset + cols + (k - (TAPS - 1) // 2) * dilation
        valid = (src >= 0) & (src < length) & (cols < width)
        xv = tl.load(x_ptr + row * length + src, mask=valid, other=0.0).to(tl.float32)
        s = tl.sin(a * xv)
        w = tl.load(w_ptr + c * TAPS + k).to(tl.float32)
        acc += w * (xv + s * s * inv)
    tl.store(out_ptr + row * width + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < width)
