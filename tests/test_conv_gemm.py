"""A streaming step's convolutions as GEMMs (`mstar.kernels.codec.conv`) against
torch's own, on the CPU: dilations, kernel 1, transposed kernels of one and
two blocks, with and without bias; and code2wav's step dispatching to them
(on CUDA) gives the whole decode, in the GPU tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.kernels.codec.conv import blocks_weight, conv1d_gemm, conv_transpose1d_blocks


@pytest.mark.parametrize("kernel,dilation", [(1, 1), (7, 1), (7, 3), (7, 9), (2, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv1d_gemm_is_conv1d(kernel: int, dilation: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(kernel * 10 + dilation)
    x = torch.randn(3, 5, 70, generator=g, dtype=torch.float64)
    w = torch.randn(4, 5, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64) if with_bias else None
    got = conv1d_gemm(x, w, b, dilation)
    torch.testing.assert_close(got, F.conv1d(x, w, b, dilation=dilation), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m,stride", [(1, 2), (2, 8), (2, 3), (3, 4)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_transposed_blocks_are_the_cut_transposed_conv(m: int, stride: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 10 + stride)
    kernel, trim = m * stride, (m - 1) * stride
    x = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    w = torch.randn(6, 3, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64) if with_bias else None
    full = F.conv_transpose1d(x, w, b, stride=stride)
    got = conv_transpose1d_blocks(x, blocks_weight(w, stride), b, stride)
    torch.testing.assert_close(got, full[..., trim:full.shape[-1] - trim], rtol=1e-12, atol=1e-12)


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="conv1d_gemm"):
        conv1d_gemm(torch.zeros(1, 5, 6), torch.zeros(4, 5, 7), None, 1)
    with pytest.raises(ValueError, match="conv1d_gemm"):
        conv1d_gemm(torch.zeros(1, 3, 20), torch.zeros(4, 5, 7), None, 1)
    with pytest.raises(ValueError, match="blocks"):
        conv_transpose1d_blocks(torch.zeros(1, 5, 6), blocks_weight(torch.zeros(4, 3, 8), 4), None, 4)
