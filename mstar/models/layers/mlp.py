"""SwiGLU feed-forward: hidden states [T, H] -> [T, H].

Gate and up projections are one merged weight (`gate_up`, laid out at load), so
the block runs two matmuls: `down(silu(gate) * up)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.layers.linear import Linear, MergedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up = MergedLinear(hidden, (("gate", intermediate), ("up", intermediate)), bias,
                                    device=device, dtype=dtype)
        self.down = Linear(intermediate, hidden, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.split(self.gate_up(x))
        return self.down(F.silu(gate) * up)
