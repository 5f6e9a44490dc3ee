"""code2wav's convolution side: activations [B, C, T] in and out, every block
causal. Each block computes a whole sequence (`forward`, zeros before its
start) or the next piece of one (`step`: the new samples and the block's
carried buffer in, the output samples those inputs finish and the next
buffer out), and the two agree sample for sample.

- `CausalConv`: a convolution that sees only the present and the past; its
  buffer is the last `reach` inputs.
- `CausalTransConv`: a transposed convolution with kernel m * stride, the
  first and last (m - 1) * stride outputs cut. Output block j needs inputs
  j .. j + m - 1, so a step keeps the last m - 1 inputs and emits one block
  per new input. A row's first m - 1 blocks come from the empty buffer and
  land before the sequence's start, where the whole decode cuts (`lag`):
  from there on the output is the whole decode's, shifted.
- `SnakeBeta`: x + sin(x e^a)^2 / (e^b + 1e-9), a and b learned per channel.
- `ConvNeXt`: causal depthwise conv k7, LayerNorm, 4x MLP with GELU, scaled
  residual.
- `ResidualUnit` (snake, dilated causal conv k7, snake, conv k1, plus the
  input) and `DecoderBlock` (snake, transposed conv upsampling by `rate`,
  units of dilation 1, 3, 9).

A step's `keep` [B, T] marks the samples that exist in the whole decode: a
row's first steps also carry samples from before the sequence's start, which
are zeroed where a convolution would read them, as the whole decode's padding
is zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.codec.conv import blocks_weight, conv1d_gemm, conv_transpose1d_blocks
from mstar.kernels.codec.snake import snake_beta, snake_beta_held
from mstar.models.layers.linear import Linear

Device = torch.device | str | None
DILATIONS = (1, 3, 9)
KERNEL = 7
SNAKE_EPS = 1e-9


def _param(*shape: int, device: Device, dtype: torch.dtype | None, fill: float | None = None) -> nn.Parameter:
    # empty unless a fill is asked: the loader overwrites every value
    t = torch.empty(*shape, device=device, dtype=dtype)
    if fill is not None:
        t.fill_(fill)
    return nn.Parameter(t, requires_grad=False)


class CausalConv(nn.Module):
    """conv1d over [B, in, T] -> [B, out, T], output t reading inputs
    t - reach .. t."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1, groups: int = 1, *,
                 device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dilation, self.groups = dilation, groups
        self.reach = (kernel - 1) * dilation
        self.in_channels = in_channels
        self.weight = _param(out_channels, in_channels // groups, kernel, device=device, dtype=dtype)
        self.bias = _param(out_channels, device=device, dtype=dtype)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.reach)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, dilation=self.dilation, groups=self.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv(F.pad(x, (self.reach, 0)))

    def step(self, x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, in, n] after the inputs `buf` [B, in, reach] holds."""
        return self.advance(torch.cat([buf, x], dim=-1) if self.reach else x)

    def advance(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` from its inputs already after the held ones: [B, in, reach + n]."""
        if _as_gemm(full) and self.groups == 1:
            y = conv1d_gemm(full, self.weight, self.bias, self.dilation)
        else:
            y = self._conv(full)
        return y, full[..., full.shape[-1] - self.reach:]


class CausalTransConv(nn.Module):
    """[B, in, T] -> [B, out, T * stride]; kernel = m * stride."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if kernel % stride:
            raise ValueError(f"a causal transposed conv needs a kernel ({kernel}) that is a multiple of its "
                             f"stride ({stride})")
        self.stride, self.trim = stride, kernel - stride
        self.reach = kernel // stride - 1   # inputs before the new ones that a new block also needs
        self.in_channels = in_channels
        self.weight = _param(in_channels, out_channels, kernel, device=device, dtype=dtype)
        self.bias = _param(out_channels, device=device, dtype=dtype)
        self._blocks = Kept(lambda w: (blocks_weight(w, stride),))

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.reach)

    def lag(self, lag_in: int) -> int:
        """Samples before the sequence's start at the output of a row's steps
        when its input carries `lag_in` of them."""
        return (lag_in + self.reach) * self.stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv_transpose1d(x, self.weight, self.bias, stride=self.stride)
        return y[..., self.trim:y.shape[-1] - self.trim]

    def step(self, x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.advance(torch.cat([buf, x], dim=-1))

    def advance(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` from [held inputs, new inputs]: the whole-sequence cut
        applied to them leaves exactly the blocks the new inputs complete."""
        if _as_gemm(full):
            y = conv_transpose1d_blocks(full, *self._blocks(self.weight), self.bias, self.stride)
        else:
            y = self.forward(full)
        return y, full[..., full.shape[-1] - self.reach:]


def _as_gemm(x: torch.Tensor) -> bool:
    """A step's dense convolutions run as GEMMs on CUDA (`mstar.kernels.codec.conv`),
    where cuDNN's choices at a step's shapes are slow; elsewhere torch's."""
    return x.is_cuda and not torch.is_grad_enabled()


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    try:
        return t.data_ptr(), t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return t.data_ptr(), -1


class Kept:
    """Tensors worked out from parameters, kept between steps: worked out
    again only when the parameters change (written in place, where torch
    counts that; inference tensors, which it does not, are loaded before a
    module's first step), into the same tensors, as a captured graph reads
    them. A step then needs no launches for them. Under autograd they are
    worked out each time and never kept."""

    def __init__(self, make: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        self.make = make
        self._stamps: tuple[tuple[int, int], ...] | None = None
        self._kept: tuple[torch.Tensor, ...] = ()

    def __call__(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled():
            return self.make(*params)
        stamps = tuple(_stamp(p) for p in params)
        if self._stamps is None or [s[0] for s in self._stamps] != [s[0] for s in stamps]:
            self._kept = tuple(t.contiguous() for t in self.make(*params))  # first use, or new storage
        elif self._stamps != stamps:
            for kept, fresh in zip(self._kept, self.make(*params), strict=True):
                kept.copy_(fresh)
        self._stamps = stamps
        return self._kept


class SnakeBeta(nn.Module):
    def __init__(self, channels: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.alpha = _param(channels, device=device, dtype=dtype, fill=0.0)   # log frequency
        self.beta = _param(channels, device=device, dtype=dtype, fill=0.0)    # log magnitude
        self._scales = Kept(lambda a, b: (a.exp()[None, :, None], b.exp()[None, :, None]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freq, magnitude = self._scales(self.alpha, self.beta)
        return snake_beta(x, freq, magnitude, SNAKE_EPS)

    def before(self, x: torch.Tensor, held: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """What the causal convolution after this activation steps on: its
        `held` inputs, then this activation of `x` zeroed where `keep` [B, T]
        is False (samples from before the sequence's start)."""
        freq, magnitude = self._scales(self.alpha, self.beta)
        return snake_beta_held(x, freq, magnitude, SNAKE_EPS, held, keep)


class ConvNeXt(nn.Module):
    def __init__(self, dim: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dwconv = CausalConv(dim, dim, KERNEL, groups=dim, **kw)
        self.norm = nn.LayerNorm(dim, eps=1e-6, **kw).requires_grad_(False)
        self.pwconv1 = Linear(dim, 4 * dim, bias=True, **kw)
        self.pwconv2 = Linear(4 * dim, dim, bias=True, **kw)
        self.gamma = _param(dim, **kw)

    def _mix(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h.transpose(1, 2)))))
        return x + (self.gamma * h).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x, self.dwconv(x))

    def step(self, x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, buf = self.dwconv.step(x, buf)
        return self._mix(x, h), buf


class Upsample(nn.Module):
    """Transposed conv with kernel = stride = `ratio` (no overlap), then a
    ConvNeXt block."""

    def __init__(self, dim: int, ratio: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.up = CausalTransConv(dim, dim, ratio, ratio, device=device, dtype=dtype)
        self.convnext = ConvNeXt(dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convnext(self.up(x))

    def step(self, x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.convnext.step(self.up(x), buf)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.act1 = SnakeBeta(dim, **kw)
        self.conv1 = CausalConv(dim, dim, KERNEL, dilation, **kw)
        self.act2 = SnakeBeta(dim, **kw)
        self.conv2 = CausalConv(dim, dim, 1, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))

    def step(self, x: torch.Tensor, buf: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, buf = self.conv1.advance(self.act1.before(x, buf, keep))
        y, _ = self.conv2.advance(self.act2(h))   # kernel 1: nothing held
        return x + y, buf


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.snake = SnakeBeta(in_dim, **kw)
        self.up = CausalTransConv(in_dim, out_dim, 2 * rate, rate, **kw)
        self.units = nn.ModuleList(ResidualUnit(out_dim, d, **kw) for d in DILATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.snake(x))
        for unit in self.units:
            x = unit(x)
        return x

    def step(self, x: torch.Tensor, bufs: list[torch.Tensor],
             keep: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """bufs: the transposed conv's, then each unit's; `keep` at the output
        rate."""
        x, up = self.up.advance(self.snake.before(x, bufs[0]))
        out = [up]
        for unit, buf in zip(self.units, bufs[1:], strict=True):
            x, buf = unit.step(x, buf, keep)
            out.append(buf)
        return x, out
