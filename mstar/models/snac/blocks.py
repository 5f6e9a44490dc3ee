"""The decoder's building blocks; activations [B, C, T] in and out.

- `Snake`: x + sin(alpha x)^2 / alpha with a learned alpha per channel, the
  periodic activation of SNAC/DAC vocoders.
- `ResidualUnit`: snake, dilated (depthwise) conv k=7, snake, 1x1 conv, plus
  the input. Same length in and out.
- `NoiseInjection`: x + noise * proj(x), noise [B, 1, T] drawn by the caller.
- `UpsampleBlock`: snake, transposed conv (T -> T * stride), noise, three
  residual units with dilations 1, 3, 9.

Convolutions are plain `nn.Conv1d`/`nn.ConvTranspose1d`: the checkpoint's
weight normalisation is folded into their weights at load, so a forward does
no weight-norm work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar.kernels.snake import snake, snake_dwconv

Device = torch.device | str | None
DILATIONS = (1, 3, 9)
KERNEL = 7


class Snake(nn.Module):
    def __init__(self, channels: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        pad = (KERNEL - 1) * dilation // 2   # odd kernel: the output keeps the input's length
        self.snake1 = Snake(dim, device=device, dtype=dtype)
        self.conv = nn.Conv1d(dim, dim, KERNEL, dilation=dilation, padding=pad, groups=groups,
                              device=device, dtype=dtype)
        self.snake2 = Snake(dim, device=device, dtype=dtype)
        self.proj = nn.Conv1d(dim, dim, 1, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv.groups == self.conv.in_channels:  # depthwise (SNAC 24 kHz): snake and conv in one pass
            h = snake_dwconv(x, self.snake1.alpha, self.conv.weight, self.conv.bias, self.conv.dilation[0])
        else:
            h = self.conv(self.snake1(x))
        y = self.proj(self.snake2(h))
        # y is this unit's own temporary: add the input into it instead of a third buffer
        return y.add_(x) if not torch.is_grad_enabled() else x + y


class NoiseInjection(nn.Module):
    def __init__(self, dim: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.proj = nn.Conv1d(dim, dim, 1, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if torch.is_grad_enabled():
            return x + noise * h
        return h.mul_(noise).add_(x)   # in place on proj's output: noise * h, then x + that


class UpsampleBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int, noise: bool, groups: int, *,
                 device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.stride = stride
        self.snake = Snake(in_dim, device=device, dtype=dtype)
        # kernel 2s, padding ceil(s/2), output padding s % 2: exactly T * s samples out
        self.upsample = nn.ConvTranspose1d(in_dim, out_dim, 2 * stride, stride=stride,
                                           padding=math.ceil(stride / 2), output_padding=stride % 2,
                                           device=device, dtype=dtype)
        self.noise = NoiseInjection(out_dim, device=device, dtype=dtype) if noise else None
        self.residuals = nn.ModuleList(ResidualUnit(out_dim, d, groups, device=device, dtype=dtype)
                                       for d in DILATIONS)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """`noise` [B, 1, T * stride]; None skips the noise (also when the
        config has none)."""
        x = self.upsample(self.snake(x))
        if self.noise is not None and noise is not None:
            x = self.noise(x, noise)
        for unit in self.residuals:
            x = unit(x)
        return x
