"""Per-head RMSNorm, then rotary: queries or keys x [T, heads, D], the norm's
weight [D] and each token's rotary angles cos/sin [T, D] in; the normed,
rotated heads out in x's dtype (Qwen3's q_norm / k_norm before M-RoPE).
`rope` is the rotation alone (code2wav's transformer).

Unfused that is about nine launches per tensor per layer (the norm, then
the rotation's casts, negation, concatenation, products and sum), and at
decode a launch costs more than its work. The rounding follows the unfused
path: the norm rounds to x's dtype before and after its weight multiply
(`norm.rms_norm_reference`), the rotation is computed in float32 from that
and rounded once.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton
from mstar.kernels.norm import rms_norm_reference
from mstar.kernels.rope_kv import rotate_half


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    if use_triton(x):
        return head_norm_rope_triton(x, weight, cos, sin, eps)
    return head_norm_rope_reference(x, weight, cos, sin, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation alone (no norm): x [T, heads, D] at each token's angles
    cos/sin [T, D], computed in float32 (or x's dtype where finer)."""
    if use_triton(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return head_norm_rope_triton(x, None, cos, sin, 0.0)
    return rope_reference(x, cos, sin)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return (h * cos[:, None] + rotate_half(h) * sin[:, None]).to(x.dtype)


def head_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             eps: float) -> torch.Tensor:
    h = rms_norm_reference(x, weight, eps).float()
    return (h * cos[:, None] + rotate_half(h) * sin[:, None]).to(x.dtype)


def head_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """`weight` None: the rotation alone (`rope`)."""
    t, heads, d = x.shape
    if (weight is not None and weight.shape != (d,)) or cos.shape != (t, d) or sin.shape != (t, d) or d % 2:
        raise ValueError(f"x {tuple(x.shape)}, weight {None if weight is None else tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)} and "
                         f"sin {tuple(sin.shape)} do not fit: need [T, H, D], [D], [T, D] with D even")
    if x.stride(2) != 1 or x.stride(1) != d:  # heads packed, tokens at any stride (a slice of a qkv output)
        x = x.contiguous()
    # a token stride of 0 (every token at one position, an expanded view) is read as it is
    cos, sin = (c if c.stride(-1) == 1 and c.stride(0) in (0, d) else c.contiguous() for c in (cos, sin))
    out = torch.empty_like(x)
    if x.numel():
        block = block_size(d)
        w = weight.contiguous() if weight is not None else x  # not read without the norm
        _kernel[(t * heads,)](x, w, cos, sin, out, heads, d, x.stride(0), cos.stride(0), sin.stride(0), eps,
                              NORM=weight is not None, BLOCK=block, num_warps=num_warps(block))
    return out


@jit
def _kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, d, stride_x, stride_cos, stride_sin, eps,
            NORM: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (token, head); its row and the row's other half (rotate_half's partner) in registers
    row = tl.program_id(0).to(tl.int64)
    token = row // heads
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    half = d // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    dtype = out_ptr.dtype.element_ty
    at = token * stride_x + (row - token * heads) * d
    x = tl.load(x_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + at + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        n = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        np_ = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    else:
        n, np_ = x, xp
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(cols < half, -np_, np_)
    tl.store(out_ptr + row * d + cols, (n * c + rotated * s).to(dtype), mask=mask)
