"""Row padding of eager projections: the sizes it picks, and (on CUDA) that a
padded projection gives the rows an unpadded one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mstar.models.layers.linear import SMALL_ROWS, Linear, padded_rows


def test_padded_rows_keeps_small_counts_and_rounds_the_rest_to_few_sizes() -> None:
    sizes = [padded_rows(n) for n in range(1, 8193)]
    assert sizes[:SMALL_ROWS] == list(range(1, SMALL_ROWS + 1))
    assert all(p >= n for n, p in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert all(p - n < 32 or p <= 1.25 * n for n, p in enumerate(sizes, start=1))
    assert len(set(sizes)) == 16 + 16 + 12 + 12  # 1-16, then by 32 to 512, 128 to 2048, 512 to 8192
    assert [padded_rows(n) for n in (17, 32, 33, 513, 2049)] == [32, 32, 64, 640, 2560]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pads on CUDA only (runs on the GPU machine)")
@pytest.mark.parametrize("rows", [1, 16, 17, 37, 291, 512, 1029])
def test_a_padded_projection_gives_each_row_what_an_unpadded_one_does(rows: int) -> None:
    torch.manual_seed(0)
    lin = Linear(256, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    lin.weight.normal_(0, 0.05)
    lin.bias.normal_(0, 0.05)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    got = lin(x)
    assert got.shape == (rows, 384) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), atol=2e-2, rtol=2e-2)
