"""RMSNorm: hidden states [T, H] in, normalised hidden states [T, H] out.

The statistics are taken in float32 whatever the activation dtype, as the
reference implementation does, so bf16 runs stay close to fp32 ones.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / rms(x)` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # cast before the weight multiply, as the reference does: changing the order
        # changes bf16 rounding and breaks logit parity
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
