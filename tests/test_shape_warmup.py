"""Startup's run of every row count an eager projection takes
(`models/layers/shape_warmup.py`)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from mstar.models.layers import Linear, MergedLinear, VocabHead, qkv_linear
from mstar.models.layers.linear import SMALL_ROWS, padded_rows
from mstar.models.layers.shape_warmup import row_counts, warm_projections

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


@pytest.mark.parametrize("top", [1, 2, 16, 17, 40, 512, 513, 2048, 2049, 8192, 10000])
def test_row_counts_are_every_padded_count_up_to_the_top_and_no_other(top: int) -> None:
    counts = row_counts(top)
    assert counts == sorted(set(counts))
    assert set(counts) == {padded_rows(n) for n in range(2, top + 1)}
    assert all(n in counts for n in range(2, min(top, SMALL_ROWS) + 1))  # small counts each their own


def _model() -> nn.Module:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = qkv_linear(64, 4, 2, 16)
            self.o = Linear(64, 64)
            self.up = MergedLinear(64, [("gate", 128), ("up", 128)])
            self.down = Linear(128, 64)

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer()])
    model.head = VocabHead(64, 300)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


def test_nothing_runs_off_cuda() -> None:
    assert warm_projections(_model(), torch.float32, 64, 8) == 0


def test_each_distinct_projection_runs_once_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers of four projections hold four distinct ones (o and down
    differ in shape); the head runs up to its own top. The device check is
    the only thing told otherwise here: on the CPU the calls run as given."""
    model = _model()
    seen: list[tuple[str, int]] = []

    def recording(cls):
        forward = cls.forward

        def call(self, x):
            seen.append((type(self).__name__, tuple(self.weight.shape), x.shape[0]))
            return forward(self, x)
        return call

    with mock.patch.object(Linear, "forward", recording(Linear)), \
            mock.patch.object(VocabHead, "forward", recording(VocabHead)), \
            mock.patch("mstar.models.layers.shape_warmup._on_cuda", lambda t: True):
        calls = warm_projections(model, torch.float32, 40, 8)
    shapes = {(kind, shape) for kind, shape, _ in seen}
    assert shapes == {("MergedLinear", (128, 64)), ("Linear", (64, 64)), ("MergedLinear", (256, 64)),
                      ("Linear", (64, 128)), ("VocabHead", (300, 64))}
    for kind, shape in shapes:
        rows = [n for k, s, n in seen if (k, s) == (kind, shape)]
        assert rows == row_counts(8 if kind == "VocabHead" else 40)
    assert calls == len(seen) == 4 * len(row_counts(40)) + len(row_counts(8))


@cuda
def test_on_cuda_the_projections_run_and_change_nothing() -> None:
    model = _model().to("cuda", torch.bfloat16)
    before = {name: p.clone() for name, p in model.named_parameters()}
    calls = warm_projections(model, torch.bfloat16, 600, 64)
    assert calls == 4 * len(row_counts(600)) + len(row_counts(64))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
