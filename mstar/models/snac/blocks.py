"""The decoder's building blocks; activations [B, C, T] in and out.

- `Snake`: x + sin(alpha x)^2 / alpha with a learned alpha per channel, the
  periodic activation of SNAC/DAC vocoders.
- `ResidualUnit`: snake, dilated (depthwise) conv k=7, snake, 1x1 conv, plus
  the input. Same length in and out.
- `NoiseInjection`: x + noise * proj(x), noise [B, 1, T] drawn by the caller.
- `UpsampleBlock`: snake, transposed conv (T -> T * stride), noise, three
  residual units with dilations 1, 3, 9.

Each block also runs over spans (`spans.py`): `need(out)` is the input span
its output span reads, `forward_span` computes just that output span from
an input holding it, with the values the whole forward gives there.

Convolutions are plain `nn.Conv1d`/`nn.ConvTranspose1d`: the checkpoint's
weight normalisation is folded into their weights at load, so a forward does
no weight-norm work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar.kernels.codec.snake import snake, snake_dwconv
from mstar.kernels.codec.snake_unit import dwconv_snake, residual_snake
from mstar.models.snac.spans import Span, conv_need, take, upsample_need

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

    @property
    def reach(self) -> int:
        return self.conv.padding[0]

    def need(self, out: Span) -> Span:
        return conv_need(out, self.reach)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = Span.whole(x.shape[-1])
        return self.forward_span(x, whole, whole)

    def forward_span(self, x: torch.Tensor, held: Span, out: Span) -> torch.Tensor:
        """x [B, C, held.width] holding `held` (at least `need(out)`) ->
        [B, C, out.width]."""
        offset = out.start - held.start
        if self.conv.groups == self.conv.in_channels:  # depthwise (SNAC 24 kHz): snake and conv in one pass
            h = snake_dwconv(x, self.snake1.alpha, self.conv.weight, self.conv.bias, self.conv.dilation[0],
                             offset, out.width)
        else:
            h = self.conv(self.snake1(x))[..., offset:offset + out.width]
        y = self.proj(self.snake2(h))
        skip = take(x, held, out)
        # y is this unit's own temporary: add the input into it instead of a third buffer
        return y.add_(skip) if not torch.is_grad_enabled() else skip + y

    def forward_fused(self, x: torch.Tensor, sx: torch.Tensor, held: Span, out: Span,
                      next_alpha: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A depthwise unit in three passes (`kernels/codec/snake_unit.py`): x and
        its first snake `sx`, both holding `held` -> the unit's output over
        `out`, and the next snake (`next_alpha`) of it."""
        h = dwconv_snake(sx, self.conv.weight, self.conv.bias, self.snake2.alpha, self.conv.dilation[0],
                         out.start - held.start, out.width)
        y = torch.bmm(self.proj.weight[:, :, 0].expand(h.shape[0], -1, -1), h)
        return residual_snake(take(x, held, out), y, self.proj.bias, next_alpha)


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

    def spans(self, out: Span, in_length: int) -> list[Span]:
        """What each stage must hold for output span `out` of an input of
        `in_length`: [the input, the upsampled (and noised) signal, each
        residual unit's output]; the last is `out`."""
        held = [out]
        for unit in reversed(self.residuals):
            held.insert(0, unit.need(held[0]))
        conv = self.upsample
        return [upsample_need(held[0], self.stride, conv.padding[0], in_length), *held]

    def _upsampled(self, sx: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """The transposed conv of the input's snake `sx` (holding spans[0]), over spans[1]."""
        conv = self.upsample
        y = torch.nn.functional.conv_transpose1d(sx, conv.weight, conv.bias, stride=self.stride)
        # y[u] is the whole output's position u + held.start * stride - padding (the inputs before the span
        # add nothing to the positions asked for)
        first = spans[1].start - (spans[0].start * self.stride - conv.padding[0])
        return y[..., first:first + spans[1].width]

    def forward_fused(self, sx: torch.Tensor, spans: list[Span], noise: torch.Tensor | None,
                      next_alpha: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depthwise residual units in passes that carry each snake along:
        the input's snake `sx` (holding spans[0]) -> the block's output over
        spans[-1], and its snake by `next_alpha` (what reads it next)."""
        x = self._upsampled(sx, spans)
        first = self.residuals[0].snake1.alpha
        if self.noise is not None and noise is not None:
            h = torch.bmm(self.noise.proj.weight[:, :, 0].expand(x.shape[0], -1, -1), x)
            x, s = residual_snake(x, h, None, first, noise)
        else:
            s = snake(x.contiguous(), first)
        units = list(self.residuals)
        for i, (unit, held, out) in enumerate(zip(units, spans[1:], spans[2:])):
            x, s = unit.forward_fused(x, s, held, out, units[i + 1].snake1.alpha if i + 1 < len(units) else next_alpha)
        return x, s

    def forward_span(self, x: torch.Tensor, spans: list[Span], noise: torch.Tensor | None) -> torch.Tensor:
        """x holding `spans[0]` (from `spans`) -> the block's output over
        `spans[-1]`; `noise` [B, 1, spans[1].width]: the draw over spans[1]."""
        x = self._upsampled(self.snake(x), spans)
        if self.noise is not None and noise is not None:
            x = self.noise(x, noise)
        for unit, held, out in zip(self.residuals, spans[1:], spans[2:]):
            x = unit.forward_span(x, held, out)
        return x
