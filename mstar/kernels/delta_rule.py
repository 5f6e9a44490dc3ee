"""The gated delta net's math over a step's packed rows, each with a slot of
per-row state: torch references, which run on any device; CUDA steps whose
rows are all one token (decode) take the fused Triton steps of
`delta_step` instead, and CUDA steps with prompt rows in half precision
fla-core's chunked kernel where it is installed (`pip install fla-core`;
15-37x the torch form's speed on an H200: scripts/probe_delta_prefill.py).
Float32 keeps the torch form: fla's Triton matmuls take float32 inputs at
TF32 precision, and float32 serving is for exactness.

- `causal_conv_rows`: a depthwise causal convolution (then SiLU) over each
  row's new inputs, continuing from the last K - 1 inputs its slot keeps,
  which it then updates.
- `delta_rule_rows`: the gates (`gates`), then the gated delta rule over
  each row's tokens, from and back into its slot's recurrent state
  [Hv, Dk, Dv] (float32). Rows of one token each (decode) update together;
  a long row goes by chunks (`chunked_delta_rule`), a short one token by
  token.

A step's rows are `query_start` [B + 1] (on the host) over the packed
tokens, and `slots` [B] (on the device) into the state tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mstar.kernels import delta_step
from mstar.kernels.backend import block_size, use_triton
from mstar.kernels.delta_step import L2_EPS

CHUNK = 64          # tokens a chunk of `chunked_delta_rule` solves at once
CHUNKED_FROM = 16   # a row of this many tokens or more goes by chunks; shorter ones token by token


def causal_conv_rows(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     query_start: torch.Tensor, host_slots: list[int] | None = None) -> torch.Tensor:
    """x [T, C] in its dtype, weight [C, 1, K], state [S, C, K - 1] (any
    float dtype); SiLU(conv) [T, C] out, in x's dtype. `host_slots`: `slots`
    on the host, if known (rows of several tokens go one by one: without
    them, reading the slots waits for the device)."""
    if x.shape[0] == query_start.numel() - 1 and use_triton(x):
        return delta_step.conv_step(x, weight, state, slots)
    return causal_conv_rows_reference(x, weight, state, slots, query_start, host_slots)


def causal_conv_rows_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                               query_start: torch.Tensor, host_slots: list[int] | None = None) -> torch.Tensor:
    t, c = x.shape
    width = weight.shape[-1]
    if t == query_start.numel() - 1:  # one token a row: one batched window each
        window = torch.cat([state[slots].to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2)  # [B, C, K]
        state[slots] = window[:, :, 1:].to(state.dtype)
        return F.silu(F.conv1d(window, weight, groups=c)[:, :, 0]).to(x.dtype)
    out = torch.empty_like(x)
    bounds = query_start.tolist()
    for i, slot in enumerate(slots.tolist() if host_slots is None else host_slots):
        start, end = bounds[i], bounds[i + 1]
        window = torch.cat([state[slot].to(weight.dtype), x[start:end].to(weight.dtype).T], dim=1)  # [C, K-1+n]
        state[slot] = window[:, window.shape[1] - (width - 1):].to(state.dtype)
        out[start:end] = F.silu(F.conv1d(window[None], weight, groups=c)[0]).T.to(x.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of N rows: s [N, H, Dk, Dv], q/k [N, H, Dk], v [N, H, Dv],
    g/beta [N, H] -> (out [N, H, Dv], the new s)."""
    s = s * g.exp()[:, :, None, None]
    predicted = torch.einsum("nhkv,nhk->nhv", s, k)
    s = s + k[:, :, :, None] * ((v - predicted) * beta[:, :, None])[:, :, None, :]
    return torch.einsum("nhkv,nhk->nhv", s, q), s


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
          dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw gate inputs a, b [T, Hv] and the layer's A_log, dt_bias [Hv]
    -> (g, the log decay -exp(A) softplus(a + dt_bias), float32; beta,
    sigmoid(b) in b's dtype)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b)


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                    query_start: torch.Tensor, host_slots: list[int] | None = None) -> torch.Tensor:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] (Hv a multiple of Hk: each q/k head
    serves Hv / Hk consecutive value heads), the gate inputs a, b [T, Hv]
    and A_log, dt_bias [Hv] as `gates` takes them, state [S, Hv, Dk, Dv]
    float32; out [T, Hv, Dv] in v's dtype; `host_slots` as
    `causal_conv_rows` takes them."""
    dk = k.shape[-1]
    if k.shape[0] == query_start.numel() - 1 and use_triton(v) and dk == block_size(dk):
        return delta_step.recurrent_step(q, k, v, a, b, a_log, dt_bias, state, slots, v.dtype)
    chunked = fla_chunk() if use_triton(v) and v.dtype in (torch.bfloat16, torch.float16) else None
    if chunked is not None:
        return _fla_rows(chunked, q, k, v, a, b, a_log, dt_bias, state, slots, query_start)
    return delta_rule_rows_reference(q, k, v, a, b, a_log, dt_bias, state, slots, query_start, host_slots)


@functools.cache
def fla_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla-core's `chunk_gated_delta_rule`, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _fla_rows(chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              state: torch.Tensor, slots: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
    """All rows in one varlen call, from their slots' states (gathered) and back (scattered): for a prompt the
    state is read and written once against many tokens' work."""
    g, beta = gates(a, b, a_log, dt_bias)
    bounds = query_start.to(torch.long)
    out, final = chunked(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g[None], beta[None],
                         initial_state=state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=bounds.to(v.device, non_blocking=True), cu_seqlens_cpu=bounds)
    state[slots] = final
    return out[0]


def delta_rule_rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                              query_start: torch.Tensor, host_slots: list[int] | None = None) -> torch.Tensor:
    t, hk, dk = k.shape
    g, beta = gates(a, b, a_log, dt_bias)
    dtype = v.dtype
    groups = v.shape[1] // hk
    q = _l2norm(q).repeat_interleave(groups, dim=1) * dk ** -0.5
    k = _l2norm(k).repeat_interleave(groups, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    rows = query_start.numel() - 1
    if t == rows:
        out, s = _step(state[slots], q, k, v, g, beta)
        state[slots] = s
        return out.to(dtype)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = query_start.tolist()
    for i, slot in enumerate(slots.tolist() if host_slots is None else host_slots):
        start, end = bounds[i], bounds[i + 1]
        if end - start >= CHUNKED_FROM:
            out[start:end], state[slot] = chunked_delta_rule(q[start:end], k[start:end], v[start:end],
                                                             g[start:end], beta[start:end], state[slot])
            continue
        s = state[slot][None]
        for j in range(start, end):
            o, s = _step(s, q[j:j + 1], k[j:j + 1], v[j:j + 1], g[j:j + 1], beta[j:j + 1])
            out[j] = o[0]
        state[slot] = s[0]
    return out.to(dtype)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       s0: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's n tokens at once, `chunk` at a time: q, k [n, H, Dk] (q
    scaled, both normalised), v [n, H, Dv], g, beta [n, H], s0 [H, Dk, Dv],
    all float32 -> (out [n, H, Dv], the state after the last token).

    Within a chunk from state S0, with G the running sum of g and
    D[t, i] = exp(G[t] - G[i]), the state after token t is
    exp(G[t]) S0 + sum over i <= t of D[t, i] k_i u_i^T, where the writes u
    solve (I + tril(beta D (K K^T), -1)) U = beta (V - exp(G) K S0): one
    triangular solve a chunk instead of a step a token."""
    n, h, dk = k.shape
    pad = -n % chunk
    q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x for x in (q, k, v, g, beta))
    # [H, chunks, C, ...]: heads and chunks batch the matmuls; the scan over chunks carries the state
    q, k, v = (x.reshape(-1, chunk, h, x.shape[-1]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(-1, chunk, h).permute(2, 0, 1) for x in (g, beta))
    cum = g.cumsum(-1)                                                    # G: [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # D, 0 above
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = torch.eye(chunk, device=k.device) + kk.tril(-1)
    writes = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)          # the U of S0 = 0
    from_state = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False)
    attend = (q @ k.transpose(-1, -2)) * decay                            # D * (Q K^T), 0 above the diagonal
    tail = (cum[..., -1:] - cum).exp()[..., None]                         # exp(G[C] - G[i])
    out = torch.empty_like(v)
    s = s0
    for c in range(q.shape[1]):
        u = writes[:, c] - from_state[:, c] @ s
        out[:, c] = (q[:, c] * cum[:, c, :, None].exp()) @ s + attend[:, c] @ u
        s = s * cum[:, c, -1, None, None].exp() + (k[:, c] * tail[:, c]).transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(-1, h, v.shape[-1])
    return out[:n], s

