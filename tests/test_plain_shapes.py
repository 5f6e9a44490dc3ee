"""A plain mode's step over rows of several shapes (a stream's short last
chunks among full ones): one call per shape, each row's output what it gets
alone, so one short row leaves the full rows their stacked call (and graph)."""

from __future__ import annotations

import torch
from torch import nn

from mstar.engine.execution.runner import ComponentRunner
from mstar.engine.movement.tensor_store import TensorStore
from mstar.graph import Component, Step


class Recorder(nn.Module):
    """window: [B, L] -> [B, 2] (sum, length); records each call's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def window(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return torch.stack([x.sum(-1), torch.full_like(x[:, 0], x.shape[-1])], dim=-1)


def test_rows_of_several_shapes_run_in_one_call_per_shape_in_their_order() -> None:
    module = Recorder()
    runner = ComponentRunner("summer", Component(modes=("window",)), module, torch.device("cpu"), TensorStore(), None)
    step = Step("summer", "window", "x", "sum")
    lengths = [4, 4, 2, 4, 3, 2, 4]
    rows = [{"x": torch.arange(n) + 10 * i} for i, n in enumerate(lengths)]
    out = runner.plain.run(rows, step, module.window, None)
    assert sorted(module.calls) == [(1, 3), (2, 2), (4, 4)]
    for row, got in zip(rows, out["sum"]):
        assert torch.equal(got, torch.stack([row["x"].sum(), torch.tensor(row["x"].numel())]))
    module.calls.clear()
    same = runner.plain.run(rows[:2], step, module.window, None)
    assert module.calls == [(2, 4)] and same["sum"].shape == (2, 2)
