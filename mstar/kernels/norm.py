"""RMSNorm, alone or fused with the residual add that precedes it.

Hidden states x [..., H] and a weight [H] in; `weight * x / rms(x)` out, in
x's dtype. The fused form also takes the residual stream and returns
(rmsnorm(x + residual), x + residual), so a decoder layer reads and writes
its hidden states once per norm instead of three times. The gated form
(a gated delta net's output per head) multiplies the normed value by
SiLU(z) of a gate z beside it.

Statistics are taken in float32. The sum is rounded to x's dtype before it
is normalised, and the normalised value before the weight multiply, as the
reference implementation (transformers' LlamaRMSNorm after `h = h + residual`)
does: bf16 logits then match it, not just a more precise answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool = False) -> torch.Tensor:
    """`centered`: the weight is stored as an offset from one (Qwen3.5's
    norms), the product (1 + weight) * normed taken in float32 and rounded
    once."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, centered)
    return rms_norm_reference(x, weight, eps, centered)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) with residual_out = x + residual."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, centered)
    return fused_add_rms_norm_reference(x, residual, weight, eps, centered)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D] in the model's dtype, weight [D]: weight * x / rms(x) * SiLU(z)."""
    if use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_reference(x, z, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool = False) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    # cast before the weight multiply, as the reference does: the other order
    # rounds bf16 differently and breaks logit parity
    return (weight * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float, centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, centered), summed


def gated_rms_norm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm rounded to x's dtype before the weight, as `rms_norm_reference`; the gate in float32."""
    return (rms_norm_reference(x, weight, eps).float() * F.silu(z.float())).to(x.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool = False) -> torch.Tensor:
    return _launch(x, None, weight, eps, centered)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    normed, summed = _launch(x, residual, weight, eps, centered)
    assert summed is not None
    return normed, summed


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if weight.shape != (d,) or z.shape != x.shape:
        raise ValueError(f"gate {tuple(z.shape)} and weight {tuple(weight.shape)} do not match x {tuple(x.shape)}")
    rows = _rows(x)
    # the gate as [N, H, D] with its strides: a head-split view of a wider projection goes as it is
    gates = z.reshape(-1, *z.shape[-2:]) if z.dim() >= 3 else z[:, None]
    if gates.stride(-1) != 1:
        gates = gates.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = block_size(d)
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight.contiguous(), out, d, rows.stride(0),
                                                 gates.shape[1], gates.stride(0), gates.stride(1), eps,
                                                 BLOCK=block, num_warps=num_warps(block))
    return out.view(x.shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, H] with unit stride along H (a view where it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, centered: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {h}")
    rows = _rows(x)
    out = torch.empty_like(rows)
    res = _rows(residual) if residual is not None else rows
    res_out = torch.empty_like(rows) if residual is not None else out
    n = rows.shape[0]
    if n:
        block = block_size(h)
        _rms_norm_kernel[(n,)](
            rows, res, weight.contiguous(), out, res_out, h,
            rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0), eps,
            HAS_RESIDUAL=residual is not None, CENTERED=centered, BLOCK=block, num_warps=num_warps(block))
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


@jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, n_cols,
                     stride_x, stride_r, stride_out, stride_r_out, eps,
                     HAS_RESIDUAL: tl.constexpr, CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; the whole row sits in registers (BLOCK >= n_cols)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # rounded to the activation dtype as the unfused add would be, so the
        # stream carried to the next layer is the same either way
        x = (x + r).to(dtype)
        tl.store(r_out_ptr + row * stride_r_out + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if CENTERED:
        out = x * tl.rsqrt(mean_sq + eps) * (1.0 + w)
    else:
        out = (x * tl.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


@jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_cols, stride_x, z_heads, stride_z, stride_z_head, eps,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32)
    weighted = (normed * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    z_row = z_ptr + (row // z_heads) * stride_z + (row % z_heads) * stride_z_head
    z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (weighted * z * tl.sigmoid(z)).to(dtype), mask=mask)
