"""Per-head RMSNorm, then rotary: queries or keys x [T, heads, D], the norm's
weight [D] and each token's rotary angles cos/sin [T, R] in; the normed,
rotated heads out in x's dtype (Qwen3's q_norm / k_norm before M-RoPE).
R < D rotates each head's first R dims and passes the rest (Qwen3.5's
partial rotary); `centered` takes the weight as an offset from one
(Qwen3.5's norms, `norm.rms_norm`); `rounded` rounds the rotation's two
products and their sum each to x's dtype, as transformers' Qwen3.5 computes
it in bfloat16 (else the rotation is float32, rounded once). `rope` is the
rotation alone (code2wav's transformer).

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
                   eps: float, centered: bool = False, rounded: bool = False) -> torch.Tensor:
    if use_triton(x):
        return head_norm_rope_triton(x, weight, cos, sin, eps, centered, rounded)
    return head_norm_rope_reference(x, weight, cos, sin, eps, centered, rounded)


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
                             eps: float, centered: bool = False, rounded: bool = False) -> torch.Tensor:
    h = rms_norm_reference(x, weight, eps, centered)
    h = h if rounded else h.float()
    r = cos.shape[-1]
    cos, sin = (c.to(h.dtype)[:, None] for c in (cos, sin))
    turned = h[..., :r] * cos + rotate_half(h[..., :r]) * sin
    return (turned if r == h.shape[-1] else torch.cat([turned, h[..., r:]], dim=-1)).to(x.dtype)


def head_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          eps: float, centered: bool = False, rounded: bool = False) -> torch.Tensor:
    """`weight` None: the rotation alone (`rope`)."""
    t, heads, d = x.shape
    r = cos.shape[-1]
    if (weight is not None and weight.shape != (d,)) or cos.shape != (t, r) or sin.shape != (t, r) or r % 2 \
            or r > d:
        raise ValueError(f"x {tuple(x.shape)}, weight {None if weight is None else tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)} and "
                         f"sin {tuple(sin.shape)} do not fit: need [T, H, D], [D], [T, R] with R even, R <= D")
    if x.stride(2) != 1:  # each head's features packed; heads and tokens at any stride (views of a projection)
        x = x.contiguous()
    # a token stride of 0 (every token at one position, an expanded view) is read as it is
    cos, sin = (c if c.stride(-1) == 1 and c.stride(0) in (0, r) else c.contiguous() for c in (cos, sin))
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if x.numel():
        block = block_size(d)
        w = weight.contiguous() if weight is not None else x  # not read without the norm
        _kernel[(t * heads,)](x, w, cos, sin, out, heads, d, r, x.stride(0), x.stride(1), cos.stride(0),
                              sin.stride(0), eps, NORM=weight is not None, CENTERED=centered, ROUNDED=rounded,
                              BLOCK=block, num_warps=num_warps(block))
    return out


@jit
def _kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, d, r, stride_x, stride_head, stride_cos, stride_sin,
            eps, NORM: tl.constexpr, CENTERED: tl.constexpr, ROUNDED: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (token, head); its row and the row's rotated part's other half (rotate_half's
    # partner) in registers; dims from r on are not rotated
    row = tl.program_id(0).to(tl.int64)
    token = row // heads
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    turns = cols < r
    half = r // 2
    partner = tl.where(cols < half, cols + half, tl.where(turns, cols - half, cols))
    dtype = out_ptr.dtype.element_ty
    at = token * stride_x + (row - token * heads) * stride_head
    x = tl.load(x_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + at + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        if CENTERED:
            n = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
            np_ = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        else:
            n = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            np_ = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    else:
        n, np_ = x, xp
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=turns, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=turns, other=0.0).to(tl.float32)
    rotated = tl.where(cols < half, -np_, np_)
    if ROUNDED:
        c, s = c.to(dtype).to(tl.float32), s.to(dtype).to(tl.float32)
        out = (n * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)
    else:
        out = n * c + rotated * s
    tl.store(out_ptr + row * d + cols, out.to(dtype), mask=mask)
