"""In-mode draws (`TokenBatch.draw`): a step's draws taken from static
buffers, as a CUDA graph of the step takes them, draw what the eager draws
do, row for row, on every sampler path, with the bucket's padding rows
drawing greedily and leaving the real rows alone; the sampler path a step's
rows take is the one its graph was captured for."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.execution.draws import Draws, StaticDraws
from mstar.engine.execution.sampler import SamplingTensors
from mstar.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=0.8)
FILTERED = SamplingParams(temperature=1.0, top_k=5, top_p=0.8)


def _draws(params: list[SamplingParams], counters: list[int], count: int = 3) -> Draws:
    seeds = [11 + 7 * i for i in range(len(params))]
    return Draws(SamplingTensors.build(params, seeds, counters, "cpu"), count)


@pytest.mark.parametrize("params,kind", [([GREEDY, GREEDY, GREEDY], "greedy"), ([PLAIN, GREEDY, PLAIN], "plain"),
                                         ([FILTERED, PLAIN, GREEDY], "filtered")])
def test_static_draws_equal_the_eager_draws_row_for_row(params: list[SamplingParams], kind: str) -> None:
    torch.manual_seed(0)
    eager = _draws(params, [0, 4, 9])
    assert eager.kind == kind
    static = StaticDraws(8, 3, torch.device("cpu"))
    static.load(eager, 4)
    bound = static.bound(4, kind)
    logits = torch.randn(3, 64) * 2
    padded = torch.cat([logits, torch.randn(1, 64)])
    for j in range(3):
        got = bound(padded, j)
        assert torch.equal(got[:3], eager(logits, j)), j
        assert got[3] == padded[3].argmax()  # the padding row draws greedily


def test_draws_j_move_the_counter_and_stop_at_the_declared_count() -> None:
    draws = _draws([PLAIN] * 4, [0, 0, 0, 0], count=2)
    logits = torch.zeros(4, 1000)
    assert not torch.equal(draws(logits, 0), draws(logits, 1))
    assert torch.equal(draws(logits, 1), _draws([PLAIN] * 4, [1, 1, 1, 1], count=2)(logits, 0))
    with pytest.raises(IndexError):
        draws(logits, 2)


def test_a_repetition_penalty_has_no_graph_path() -> None:
    assert _draws([SamplingParams(temperature=1.0, repetition_penalty=1.1)], [0]).kind is None


def test_a_reload_with_fewer_rows_pads_the_rows_the_last_step_used() -> None:
    static = StaticDraws(4, 1, torch.device("cpu"))
    static.load(_draws([PLAIN] * 4, [3] * 4, count=1), 4)
    static.load(_draws([PLAIN], [5], count=1), 4)
    assert static.temperature.tolist() == [pytest.approx(0.8), 0.0, 0.0, 0.0]
    assert static.counters.tolist() == [5, 0, 0, 0]
