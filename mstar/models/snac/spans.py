"""Spans: which positions of a signal a layer must compute so that the
decoder's output is exact over a requested sample range.

A window decode plays only part of its output (Orpheus hears the second of
four frames). Every layer of the decoder is local: a "same" convolution of
reach r reads r positions either side, a transposed convolution of stride s
reads two input positions per output, the rest is pointwise. So the played
samples depend on a cone of positions that narrows toward the output, and
positions outside it need not be computed. Walking the layers backward from
the played range gives each layer's span; walking forward over the spans,
with zeros where a span meets the signal's true ends (the padding the full
decode sees), gives the same values the full decode gives on those spans.

A `Span(start, stop, length)` is positions [start, stop) of a signal of
`length` positions; a tensor [B, C, stop - start] "holds" it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.kernels.codec.snake import conv_window


@dataclass(frozen=True)
class Span:
    start: int
    stop: int
    length: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.length:
            raise ValueError(f"span [{self.start}, {self.stop}) does not lie in a signal of {self.length}")

    @property
    def width(self) -> int:
        return self.stop - self.start

    @classmethod
    def whole(cls, length: int) -> Span:
        return cls(0, length, length)


def conv_need(out: Span, reach: int) -> Span:
    """The input span a "same" convolution of `reach` ((kernel - 1) *
    dilation / 2 either side) reads to compute `out`."""
    return Span(max(0, out.start - reach), min(out.length, out.stop + reach), out.length)


def upsample_need(out: Span, stride: int, padding: int, in_length: int) -> Span:
    """The input span a transposed convolution (kernel 2 * stride, `stride`,
    `padding`) reads to compute `out`: output t sums inputs i with
    0 <= t + padding - i * stride < 2 * stride."""
    first = -(-(out.start + padding - 2 * stride + 1) // stride)
    last = (out.stop - 1 + padding) // stride
    return Span(max(0, first), min(in_length, last + 1), in_length)


def take(x: torch.Tensor, held: Span, want: Span) -> torch.Tensor:
    """The part of `x` (holding `held`) over `want`, a span inside it."""
    if want.start < held.start or want.stop > held.stop:
        raise ValueError(f"span [{want.start}, {want.stop}) is not inside the held [{held.start}, {held.stop})")
    return x[..., want.start - held.start:want.stop - held.start]


def conv_span(conv: nn.Conv1d, x: torch.Tensor, held: Span, out: Span) -> torch.Tensor:
    """`conv` (a "same" convolution: odd kernel, padding its reach) over
    `out` alone, from x [B, C, held.width] holding `held`: what the padded
    convolution of the whole signal gives there, zeros beyond its ends."""
    need = conv_need(out, conv.padding[0])
    # the part of x it reads; beyond that part's ends lie only the signal's ends
    inner = take(x, held, need)
    return conv_window(inner, conv.weight, conv.bias, conv.dilation[0], conv.groups, out.start - need.start,
                       out.width)
