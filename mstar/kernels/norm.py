"""RMSNorm, alone or fused with the residual add that precedes it.

Hidden states x [..., H] and a weight [H] in; `weight * x / rms(x)` out, in
x's dtype. The fused form also takes the residual stream and returns
(rmsnorm(x + residual), x + residual), so a decoder layer reads and writes
its hidden states once per norm instead of three times.

Statistics are taken in float32. The sum is rounded to x's dtype before it
is normalised, and the normalised value before the weight multiply, as the
reference implementation (transformers' LlamaRMSNorm after `h = h + residual`)
does: bf16 logits then match it, not just a more precise answer.
"""

from __future__ import annotations

import torch

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) with residual_out = x + residual."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # cast before the weight multiply, as the reference does: the other order
    # rounds bf16 differently and breaks logit parity
    return (weight * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    normed, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return normed, summed


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, H] with unit stride along H (a view where it can be)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
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
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps(block))
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


@jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, n_cols,
                     stride_x, stride_r, stride_out, stride_r_out, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    normed = (x * tl.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)
