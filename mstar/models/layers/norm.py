"""RMSNorm: hidden states [T, H] in, normalised hidden states [T, H] out;
with the residual stream [T, H] also in, the add fused into the norm:
(rmsnorm(x + residual), x + residual) out.

The statistics are taken in float32 whatever the activation dtype, as the
reference implementation does, so bf16 runs stay close to fp32 ones. The math
lives in `mstar.kernels.norm` (Triton on CUDA, torch elsewhere).
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from mstar.kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """`weight * x / rms(x)` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def stream(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's first norm over the residual stream carried as (h,
        residual), its value h + residual: (the normed stream, the stream).
        residual None (the first layer): the stream is h itself."""
        if residual is None:
            return self(h), h
        return self(h, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class CenteredRMSNorm(nn.Module):
    """`(1 + weight) * x / rms(x)` over the last dimension, the product taken
    in float32 and rounded once (Qwen3.5's and Qwen3-Next's norms: their
    weights are stored as offsets from one). `stream` as `RMSNorm.stream`,
    the residual add in the activations' dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, centered=True)

    def stream(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self(h), h
        return fused_add_rms_norm(h, residual, self.weight, self.eps, centered=True)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
