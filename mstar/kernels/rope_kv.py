"""Rotary embedding fused with the KV-cache write of a step's new tokens.

q [T, Hq, D], k and v [T, Hkv, D], the rotary tables cos/sin [P, D] with
each token's position [T], and one layer's K/V pages [N, page, Hkv, D] with
each token's flat slot [T] (page * page_size + offset) in; the roped q out,
and the roped k and v written into the pages (cast to the cache's dtype).

The rotation is the rotate-half layout, x * cos[p] + rotate_half(x) * sin[p],
computed in float32 and rounded once to the input dtype. Fusing it with the
store reads k once and never materialises a roped copy of it.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import block_size, dependent_launch, jit, num_warps, tl, use_triton


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    if use_triton(q):
        return rope_and_store_triton(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)
    return rope_and_store_reference(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated at `positions` [T], in float32, returned in x's dtype."""
    c = cos[positions].to(torch.float32).unsqueeze(1)   # [T, 1, D]: one angle per token, shared by all heads
    s = sin[positions].to(torch.float32).unsqueeze(1)
    h = x.to(torch.float32)
    return (h * c + rotate_half(h) * s).to(x.dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or a float8 tensor's bytes (same shape): torch has no index
    copies of float8 tensors, so float8 KV pages move as bytes."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def put_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst[index] = src cast to dst's dtype, along dim 0 (float8 too)."""
    raw(dst).index_copy_(0, index, raw(src.to(dst.dtype)))


def take_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src[index] along dim 0 for an index of any shape, in src's dtype (float8 too)."""
    return raw(src).index_select(0, index.flatten()).view(src.dtype).view(*index.shape, *src.shape[1:])


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the pages at flat slots `slot_mapping` [T]."""
    hkv, d = k.shape[1:]
    for new, pages in ((k, k_cache), (v, v_cache)):
        put_rows(pages.view(-1, hkv, d), slot_mapping, new)


def rope_and_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    store_kv(apply_rope(k, cos, sin, positions), v, k_cache, v_cache, slot_mapping)
    return apply_rope(q, cos, sin, positions)


def rope_and_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k.shape[1]
    if d % 2 or k.shape != (t, hkv, d) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "need [T, Hq, D], [T, Hkv, D], [T, Hkv, D] with an even D")
    if cos.shape[-1] != d or sin.shape != cos.shape:
        raise ValueError(f"rotary tables {tuple(cos.shape)}/{tuple(sin.shape)} do not match head_dim {d}")
    # the projections arrive as strided views of one qkv output: keep them
    # views, only the head dimension must be dense
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t:
        block_half = block_size(d // 2)
        block_q, block_kv = block_size(hq), block_size(hkv)
        pdl = dependent_launch(q)
        _rope_and_store_kernel[(t,)](
            q, k, v, cos, sin, positions, slot_mapping, out, k_flat, v_flat,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
            k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1), hq, hkv,
            HALF=d // 2, BLOCK_HALF=block_half, BLOCK_Q=block_q, BLOCK_KV=block_kv, PDL=pdl,
            num_warps=num_warps(2 * block_q * block_half), **({"launch_pdl": True} if pdl else {}))
    return out


@jit
def _rotate_heads(src, src_stride_h, dst, dst_stride_h, n_heads, cos1, cos2, sin1, sin2,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # the two halves of every head at once: out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < HALF)
    x1 = tl.load(src + heads * src_stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + heads * src_stride_h + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    # rounded to the source dtype first: a cache wider than k holds the same
    # values as an unfused rope-then-store would have written
    # (dtypes inline: Triton 3.6 cannot unpack a tuple of dtypes)
    out1 = (x1 * cos1 - x2 * sin1).to(src.dtype.element_ty).to(dst.dtype.element_ty)
    out2 = (x2 * cos2 + x1 * sin2).to(src.dtype.element_ty).to(dst.dtype.element_ty)
    tl.store(dst + heads * dst_stride_h + cols, out1, mask=mask)
    tl.store(dst + heads * dst_stride_h + HALF + cols, out2, mask=mask)


@jit
def _rope_and_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr,
                           v_cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cos, stride_sin, stride_ot, stride_oh, stride_kcs, stride_kch,
                           stride_vcs, stride_vch, n_q_heads, n_kv_heads,
                           HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_KV: tl.constexpr, PDL: tl.constexpr):
    # one program per token: its q heads, k heads and v heads
    if PDL:
        # launched while the projection before still runs (Hopper): everything here may be its output, so the
        # program waits for it first; the launch itself is what overlaps
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    in_half = cols < HALF
    # both halves of the tables are read: nothing assumes they repeat
    cos1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=in_half, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + cols, mask=in_half, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=in_half, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=in_half, other=0.0).to(tl.float32)

    _rotate_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_ot, stride_oh, n_q_heads,
                  cos1, cos2, sin1, sin2, HALF, BLOCK_HALF, BLOCK_Q)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + slot * stride_kcs, stride_kch, n_kv_heads,
                  cos1, cos2, sin1, sin2, HALF, BLOCK_HALF, BLOCK_KV)

    heads = tl.arange(0, BLOCK_KV)[:, None]
    full = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    mask = (heads < n_kv_heads) & (full < 2 * HALF)
    # v passes through fp32 too: the interpreter mishandles bf16 values that are not upcast
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + full, mask=mask, other=0.0).to(tl.float32)
    tl.store(v_cache_ptr + slot * stride_vcs + heads * stride_vch + full,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
