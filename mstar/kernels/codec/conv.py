"""1-D convolutions of a streaming step as one GEMM each: activations
[B, C, L] in, [B, O, n] out.

A vocoder's step convolves a few new samples a row after the held ones,
at batch sizes where cuDNN picks slow algorithms for dilated convolutions
(a generic implicit GEMM about ten times slower than a GEMM of the same
work) and transposes every activation to channels-last and back. Here the
input windows are laid out once (an im2col copy, a view for kernel 1) and
multiplied by the weight in one batched GEMM. `F.conv1d` and
`F.conv_transpose1d` are the references.
"""

from __future__ import annotations

import torch


def conv1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1) -> torch.Tensor:
    """conv1d(x, weight [O, C, K], bias, dilation) with no padding and one
    group: [B, C, L] -> [B, O, L - (K - 1) * dilation]."""
    out_channels, channels, kernel = weight.shape
    batch, _, length = x.shape
    n = length - (kernel - 1) * dilation
    if x.shape[1] != channels or n < 1:
        raise ValueError(f"conv1d_gemm: input {tuple(x.shape)} for weight {tuple(weight.shape)} "
                         f"at dilation {dilation}")
    x = x.contiguous()
    if kernel == 1:
        cols = x
    else:  # cols[b, c * K + k, t] = x[b, c, t + k * dilation], the weight's own (c, k) order
        cols = x.as_strided((batch, channels, kernel, n), (channels * length, length, dilation, 1))
        cols = cols.reshape(batch, channels * kernel, n)
    y = torch.matmul(weight.reshape(out_channels, channels * kernel), cols)
    return y if bias is None else y.add_(bias[:, None])


def blocks_weight(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A transposed conv's weight [C, O, m * stride] as the weight of the
    plain conv1d that emits its output blocks: [O * stride, C, m], output
    channel (o, r) and tap i holding weight[c, o, (m - 1 - i) * stride + r]."""
    channels, out_channels, kernel = weight.shape
    m = kernel // stride
    w = weight.reshape(channels, out_channels, m, stride).flip(2)
    return w.permute(1, 3, 0, 2).reshape(out_channels * stride, channels, m)


def conv_transpose1d_blocks(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None,
                            stride: int) -> torch.Tensor:
    """conv_transpose1d(x, weight [C, O, m * stride], bias, stride) with the
    first and last (m - 1) * stride outputs cut, from `blocks_weight(weight,
    stride)`: [B, C, L] -> [B, O, (L - m + 1) * stride]. Output block t
    (stride samples) reads inputs t .. t + m - 1: the blocks' conv1d, its
    channels (o, r) laid out as samples."""
    batch, channels, length = x.shape
    rows, _, m = blocks.shape
    out_channels, n = rows // stride, length - m + 1
    if blocks.shape[1] != channels or rows % stride or n < 1:
        raise ValueError(f"conv_transpose1d_blocks: input {tuple(x.shape)} for block weight {tuple(blocks.shape)} "
                         f"at stride {stride}")
    y = conv1d_gemm(x, blocks, None).view(batch, out_channels, stride, n).transpose(2, 3)
    out = torch.empty(batch, out_channels, n, stride, dtype=y.dtype, device=y.device)
    if bias is None:
        out.copy_(y)
    else:
        torch.add(y, bias.view(1, -1, 1, 1), out=out)
    return out.view(batch, out_channels, n * stride)
