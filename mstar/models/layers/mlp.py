"""SwiGLU feed-forward: hidden states [T, H] -> [T, H].

Gate and up projections are one merged weight (`gate_up`, laid out at load), so
the block runs two matmuls around one fused `silu(gate) * up`
(`mstar.kernels.activation`).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.activation import silu_and_mul
from mstar.models.layers.linear import Linear, MergedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up = MergedLinear(hidden, (("gate", intermediate), ("up", intermediate)), bias,
                                    device=device, dtype=dtype)
        self.down = Linear(intermediate, hidden, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up shards sit side by side in the merged output, the layout silu_and_mul reads
        return self.down(silu_and_mul(self.gate_up(x)))
