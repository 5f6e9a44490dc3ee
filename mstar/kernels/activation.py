"""SiLU-and-multiply, the middle of a SwiGLU MLP: the merged gate/up
projection [..., 2I] in, silu(gate) * up [..., I] out, in its dtype.

One pass over the activations instead of three (silu, multiply, and the
copies the split implies). silu(gate) is rounded to the activation dtype
before the multiply, as the unfused torch expression rounds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.kernels.backend import jit, num_warps, tl, use_triton

# columns per program: a row of a large MLP splits over several programs, so
# a decode step of a few tokens still spreads over the GPU
BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up needs an even last dimension, got {width}")
    inter = width // 2
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        grid = (rows.shape[0], (inter + BLOCK - 1) // BLOCK)
        _silu_and_mul_kernel[grid](rows, out, inter, rows.stride(0), out.stride(0),
                                   BLOCK=BLOCK, num_warps=num_warps(BLOCK))
    return out.view(*gate_up.shape[:-1], inter)


@jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)
