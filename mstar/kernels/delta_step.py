"""One token of each decode row through a gated delta net (Triton), in place
in the rows' state slots; the torch references are in `delta_rule`.

- `conv_step`: x [B, C] (the new inputs) and each row's slot of the last
  K - 1 inputs [S, C, K - 1] -> SiLU(depthwise conv) [B, C], the slot slid
  on by one input.
- `recurrent_step`: the conv's q, k [B, Hk, Dk] and v [B, Hv, Dv], the raw
  gate inputs a, b [B, Hv] and the layer's A_log, dt_bias [Hv] -> out
  [B, Hv, Dv]: the decay exp(-exp(A) softplus(a + dt_bias)) and the write
  strength sigmoid(b), q and k L2-normalised, then the delta rule on the
  slot's state [Hv, Dk, Dv] (float32), which it reads once and writes once.
  The torch form reads and writes the whole state six times over (gather,
  decay, read-out, update, scatter), which at 64 rows of a 9B model is
  ~38 GB a step against the weights' 18.

A program covers one row's value head and a block of its Dv columns, with
all Dk rows of that block of state in registers.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import block_size, cdiv, jit, tl

L2_EPS = 1e-6
# state columns a program of `recurrent_step` covers: of 16, 32 and 64 (and 2, 4 or 8 warps), 64 with 4 warps
# moved Qwen3.5-9B's states fastest on an H200 at 64 and 256 rows (scripts/probe_delta_decode.py; one row's
# state of one layer stays in L2 there, so its numbers do not say much)
_BV = 64
_BC = 256    # channels a program of `conv_step` covers


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [B, C] (row stride free, unit channel stride), weight [C, 1, K],
    state [S, C, K - 1] (slot stride free); SiLU(conv) [B, C] in x's dtype."""
    rows, channels = x.shape
    width = weight.shape[-1]
    if x.stride(1) != 1 or state.stride(2) != 1 or state.stride(1) != width - 1:
        raise ValueError("conv_step needs unit channel strides and a state of [S, C, K - 1] per slot")
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows:
        _conv_step_kernel[(rows, cdiv(channels, _BC))](
            x, weight.reshape(channels, width).contiguous(), state, slots, out, channels,
            x.stride(0), state.stride(0), WIDTH=width, TAPS=block_size(width), BC=_BC, num_warps=4)
    return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                   out_dtype: torch.dtype, block_v: int = _BV, warps: int = 4) -> torch.Tensor:
    """q, k [B, Hk, Dk], v [B, Hv, Dv] (each head's values contiguous; row
    strides free), a, b [B, Hv], state [S, Hv, Dk, Dv] float32 (slot stride
    free); out [B, Hv, Dv] in `out_dtype`. `block_v`, `warps`: a program's
    columns of state and its warps (scripts/probe_delta_decode.py sweeps them)."""
    rows, k_heads, dk = k.shape
    v_heads, dv = v.shape[1:]
    for t, d in ((q, dk), (k, dk), (v, dv)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("recurrent_step needs each head's features contiguous")
    if state.dtype != torch.float32 or state.stride(1) != dk * dv or state.stride(2) != dv or state.stride(3) != 1:
        raise ValueError("recurrent_step needs a float32 state of [S, Hv, Dk, Dv] per slot")
    if dk != block_size(dk):
        raise ValueError(f"recurrent_step needs a power-of-two key head size, not {dk}")
    a, b = (g if g.stride(1) == 1 else g.contiguous() for g in (a, b))  # heads adjacent; rows at any stride
    out = torch.empty((rows, v_heads, dv), dtype=out_dtype, device=v.device)
    bv = min(block_v, block_size(dv))
    if rows:
        _recurrent_step_kernel[(rows * v_heads, cdiv(dv, bv))](
            q, k, v, a, b, a_log, dt_bias, state, slots, out,
            q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), state.stride(0), dk ** -0.5, L2_EPS,
            HV=v_heads, GROUPS=v_heads // k_heads, DK=dk, DV=dv, BV=bv, num_warps=warps)
    return out


@jit(per_row=("slots_ptr",))  # a group's rows are a slice of the step's slots, at any offset
def _conv_step_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, channels, stride_x, stride_slot,
                      WIDTH: tl.constexpr, TAPS: tl.constexpr, BC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    taps = tl.arange(0, TAPS)
    live = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    held = state_ptr + slot * stride_slot + cols[:, None] * (WIDTH - 1)
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    # the window: the slot's K - 1 inputs, then the new one; and the window after it, one input on
    old = tl.load(held + taps[None, :], mask=live[:, None] & (taps[None, :] < WIDTH - 1), other=0.0)
    window = tl.where(taps[None, :] == WIDTH - 1, x.to(tl.float32)[:, None], old)
    later = tl.load(held + taps[None, :] + 1, mask=live[:, None] & (taps[None, :] + 1 < WIDTH - 1), other=0.0)
    later = tl.where(taps[None, :] == WIDTH - 2, x.to(tl.float32)[:, None], later)
    w = tl.load(w_ptr + cols[:, None] * WIDTH + taps[None, :], mask=live[:, None] & (taps[None, :] < WIDTH),
                other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # rounded where the reference's conv in the weights' dtype rounds, then SiLU in float32
    conv = tl.sum(window.to(w_ptr.dtype.element_ty).to(tl.float32) * w, axis=1).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * channels + cols, (conv * tl.sigmoid(conv)).to(dtype), mask=live)
    tl.store(held + taps[None, :], later, mask=live[:, None] & (taps[None, :] < WIDTH - 1))


@jit(per_row=("slots_ptr",))
def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr,
                           out_ptr, stride_q, stride_k, stride_v, stride_a, stride_b, stride_slot, scale, eps,
                           HV: tl.constexpr, GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, hv = pid // HV, pid % HV
    hk = hv // GROUPS
    ks = tl.arange(0, DK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    live = vs < DV
    q = tl.load(q_ptr + row * stride_q + hk * DK + ks).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k + hk * DK + ks).to(tl.float32)
    v = tl.load(v_ptr + row * stride_v + hv * DV + vs, mask=live, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    # the gates as the reference takes them: softplus with its threshold of 20, beta rounded to b's dtype
    a = tl.load(a_ptr + row * stride_a + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus)
    b = tl.load(b_ptr + row * stride_b + hv)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    cell = state_ptr + slot * stride_slot + hv * (DK * DV) + ks[:, None] * DV + vs[None, :]
    s = tl.load(cell, mask=live[None, :], other=0.0) * decay
    predicted = tl.sum(s * k[:, None], axis=0)
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(cell, s, mask=live[None, :])
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + (row * HV + hv) * DV + vs, out.to(out_ptr.dtype.element_ty), mask=live)
