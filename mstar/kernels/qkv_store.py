"""A qkv projection's output into attention, in one launch: per-head RMSNorm
then rotary on the q and k heads (Qwen3's q_norm / k_norm before M-RoPE),
the k and v heads written into a KV cache, the q heads out.

qkv [T, (H + 2 Hkv) * D] (q heads, then k heads, then v heads, as the merged
projection writes them), the two norms' weights [D], each token's angles
cos/sin [T, D] in; q [T, H, D] out in qkv's dtype, and token t's k and v
rows stored at row `dest(t)` of the caches' flat views k_dst / v_dst
[N, Hkv, D] (cast to the cache's dtype). `dest(t)` is `slots[t]` (a paged
cache's slot mapping), or, without slots, a dense cache's row layout:
`(t // new) * capacity + start + t % new` for B rows of `new` tokens each
landing at `start` in their `capacity`-token buffers.

Unfused that is four launches a layer (each norm-rope, then a copy for k and
one for v). The rounding is the unfused path's (`head_norm_rope`, then the
cast into the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton
from mstar.kernels.head_norm_rope import head_norm_rope_reference
from mstar.kernels.rope_kv import put_rows


@dataclass(frozen=True)
class KVDest:
    """Where a step's k and v rows go: the caches' flat views [N, Hkv, D] and
    either each token's row (`slots` [T] int64) or the dense layout (B rows of
    `new` tokens at `start` of `capacity`)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor | None = None
    new: int = 1
    start: int = 0
    capacity: int = 0

    def rows(self, tokens: int, device: torch.device) -> torch.Tensor:
        """Each token's destination row, [tokens] int64 on `device`."""
        if self.slots is not None:
            return self.slots
        t = torch.arange(tokens, device=device)
        return t // self.new * self.capacity + self.start + t % self.new


def qkv_norm_rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                        dest: KVDest) -> torch.Tensor:
    if use_triton(qkv):
        return qkv_norm_rope_store_triton(qkv, heads, kv_heads, q_weight, k_weight, cos, sin, eps, dest)
    return qkv_norm_rope_store_reference(qkv, heads, kv_heads, q_weight, k_weight, cos, sin, eps, dest)


def qkv_norm_rope_store_reference(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
                                  k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                                  dest: KVDest) -> torch.Tensor:
    t = qkv.shape[0]
    d = q_weight.shape[0]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    rows = dest.rows(t, qkv.device)
    k = head_norm_rope_reference(k.reshape(t, kv_heads, d), k_weight, cos, sin, eps)
    put_rows(dest.k, rows, k)
    put_rows(dest.v, rows, v.reshape(t, kv_heads, d))
    return head_norm_rope_reference(q.reshape(t, heads, d), q_weight, cos, sin, eps)


def qkv_norm_rope_store_triton(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                               dest: KVDest) -> torch.Tensor:
    t = qkv.shape[0]
    d = q_weight.shape[0]
    width = (heads + 2 * kv_heads) * d
    if (qkv.dim() != 2 or qkv.shape[1] != width or k_weight.shape != (d,) or cos.shape != (t, d)
            or sin.shape != (t, d) or d % 2):
        raise ValueError(f"qkv {tuple(qkv.shape)} of {heads} + 2 x {kv_heads} heads of {d}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}: need [T, (H + 2 Hkv) D], [T, D], D even")
    for cache in (dest.k, dest.v):
        if cache.dim() != 3 or cache.shape[1:] != (kv_heads, d) or cache.stride(2) != 1 or cache.stride(1) != d:
            raise ValueError(f"a cache's flat view must be [N, {kv_heads}, {d}] with heads packed, "
                             f"got {tuple(cache.shape)} strides {cache.stride()}")
    if dest.slots is None and t and (t % dest.new or dest.start + dest.new > dest.capacity
                                     or (t // dest.new) * dest.capacity > min(dest.k.shape[0], dest.v.shape[0])):
        # a store past the caches would not fail on the device: it would write over other memory
        raise ValueError(f"{t} tokens as rows of {dest.new} at {dest.start} of {dest.capacity} do not fit "
                         f"caches of {dest.k.shape[0]} rows")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    # a token stride of 0 (every token at one position, an expanded view) is read as it is
    cos, sin = (c if c.stride(-1) == 1 and c.stride(0) in (0, d) else c.contiguous() for c in (cos, sin))
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        block = block_size(d)
        slots = dest.slots if dest.slots is not None else q  # not read without slots
        _kernel[(t * (heads + 2 * kv_heads),)](
            qkv, q_weight, k_weight, cos, sin, q, dest.k, dest.v, slots,
            heads, kv_heads, d, qkv.stride(0), cos.stride(0), sin.stride(0), dest.k.stride(0), dest.v.stride(0),
            dest.new, dest.start, dest.capacity, eps,
            SLOTS=dest.slots is not None, BLOCK=block, num_warps=num_warps(block))
    return q


@jit(any_value=("new", "start", "capacity"))  # the code predictor's passes differ in start: one compile
def _kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
            heads, kv_heads, d, stride_x, stride_cos, stride_sin, stride_k, stride_v, new, start, capacity, eps,
            SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (token, head) over the q, k and v heads; a row and its rotate_half partner in registers
    row = tl.program_id(0).to(tl.int64)
    all_heads = heads + 2 * kv_heads
    token = row // all_heads
    head = row - token * all_heads
    is_q = head < heads
    is_k = (head >= heads) & (head < heads + kv_heads)
    is_v = head >= heads + kv_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    half = d // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    dtype = q_ptr.dtype.element_ty
    at = token * stride_x + head * d
    x = tl.load(qkv_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(qkv_ptr + at + partner, mask=mask, other=0.0).to(tl.float32)
    # the head's norm weight: q's or k's (v heads read neither)
    w = (tl.load(qw_ptr + cols, mask=mask & is_q, other=0.0).to(tl.float32)
         + tl.load(kw_ptr + cols, mask=mask & is_k, other=0.0).to(tl.float32))
    wp = (tl.load(qw_ptr + partner, mask=mask & is_q, other=0.0).to(tl.float32)
          + tl.load(kw_ptr + partner, mask=mask & is_k, other=0.0).to(tl.float32))
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    n = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    np_ = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
    roped = (n * c + tl.where(cols < half, -np_, np_) * s).to(dtype)
    tl.store(q_ptr + token * heads * d + head * d + cols, roped, mask=mask & is_q)
    if SLOTS:
        dest = tl.load(slot_ptr + token).to(tl.int64)
    else:
        dest = token // new * capacity + start + token % new
    kv_head = tl.where(is_k, head - heads, head - heads - kv_heads)
    tl.store(k_ptr + dest * stride_k + kv_head * d + cols, roped.to(k_ptr.dtype.element_ty), mask=mask & is_k)
    tl.store(v_ptr + dest * stride_v + kv_head * d + cols, x.to(dtype).to(v_ptr.dtype.element_ty),
             mask=mask & is_v)
