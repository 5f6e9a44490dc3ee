"""kernels/sampling/head_race.py: the CPU's filtered race over each row's
head draws exactly the tokens of the reference race over whole sorted rows,
across the filters, ties, infinities and signed zeros, and settles the rows
it should without the whole sort."""

from __future__ import annotations

import pytest
import torch

import mstar.kernels.sampling.head_race as head_race
from mstar.kernels.sampling import draw
from mstar.kernels.sampling.noise import exponential_noise_at, exponential_noise_reference
from mstar.kernels.sampling.race import filtered_race_reference

VOCAB = 20_000


def _logits(kind: str, rows: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, VOCAB, generator=g)
    if kind == "peaked":     # a trained model's: a few hundred tokens hold the mass
        x = x * 2
        x[:, :60] += 9
    elif kind == "flat":     # a random-weight model's: top-p keeps thousands
        x = x * 0.6
    elif kind == "ties":     # whole runs of equal logits, across the head's end too
        x = (x * 3).round()
    elif kind == "masked":   # banned tokens, and a zero of each sign
        x = x * 4
        x[x < -2] = float("-inf")
        x[:, 11], x[:, 12] = -0.0, 0.0
    return x


def _reference(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
               counters: torch.Tensor, first: int = 0) -> torch.Tensor:
    noise = exponential_noise_reference(seeds, counters, x.shape[-1], first)
    return filtered_race_reference(x, top_k, top_p, min_p, noise)


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_the_head_race_draws_the_reference_tokens(kind: str) -> None:
    g = torch.Generator().manual_seed(7)
    for trial in range(6):
        rows = 8
        x = _logits(kind, rows, g)
        pick = lambda options: torch.tensor([options[int(i)] for i in torch.randint(0, len(options), (rows,),  # noqa
                                                                                     generator=g)])
        top_k = pick([0, 0, 1, 7, 50, 4000, 6000, VOCAB + 3])  # 6000: past a quarter, raced whole
        top_p = pick([1.0, 0.95, 0.8, 0.5, 0.01])
        min_p = pick([0.0, 0.0, 0.05, 0.3])
        seeds = torch.randint(0, 2**40, (rows,), generator=g)
        counters = torch.randint(0, 1000, (rows,), generator=g)
        first = 13 * trial
        got = head_race.filtered_race_head(x, top_k, top_p, min_p, seeds, counters, first)
        assert got.tolist() == _reference(x, top_k, top_p, min_p, seeds, counters, first).tolist(), (kind, trial)


@pytest.mark.parametrize("ties_taken", ["as topk takes them", "highest ids first"])
def test_a_run_of_equal_logits_past_the_heads_end_is_raced_whole(ties_taken: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-k keeps 3 of 300 equal top logits: the reference keeps the 3 of lowest index, which a head of 20
    of them need not hold (topk may take any of them), so such a row goes to the whole race."""
    if ties_taken == "highest ids first":   # a choice topk may make: the run's last ids
        monkeypatch.setattr(head_race, "_head_ids",
                            lambda x, size: x.shape[-1] - 1 - x.flip(-1).topk(size, dim=-1).indices)
    g = torch.Generator().manual_seed(11)
    rows = 6
    x = torch.randn(rows, VOCAB, generator=g)
    for r in range(rows):
        x[r, torch.randperm(VOCAB, generator=g)[:300]] = 9.0
    filters = (torch.full((rows,), 3), torch.ones(rows), torch.zeros(rows))
    seeds, counters = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    want = _reference(x, *filters, seeds, counters)
    lowest = [sorted((x[r] == 9.0).nonzero().squeeze(1).tolist())[:3] for r in range(rows)]
    assert all(w in low for w, low in zip(want.tolist(), lowest))
    assert head_race.filtered_race_head(x, *filters, seeds, counters).tolist() == want.tolist()


def test_the_peaked_rows_settle_without_the_whole_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    raced: list[int] = []
    whole_race = head_race.filtered_race_reference
    monkeypatch.setattr(head_race, "filtered_race_reference", lambda x, *a: raced.append(len(x)) or whole_race(x, *a))
    g = torch.Generator().manual_seed(3)
    x = _logits("peaked", 6, g)
    filters = (torch.tensor([0, 0, 20, 0, 0, 0]), torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.5]),
               torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.2]))
    seeds, counters = torch.arange(6), torch.zeros(6, dtype=torch.long)
    got = head_race.filtered_race_head(x, *filters, seeds, counters)
    assert raced == []   # every row settled in its head
    assert got.tolist() == _reference(x, *filters, seeds, counters).tolist()
    # a row no filter cuts keeps the whole vocabulary: the whole race, as its head would be the row
    got = head_race.filtered_race_head(x[:1], torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.0]),
                                       seeds[:1], counters[:1])
    assert raced == [1] and got.tolist() == _reference(x[:1], torch.tensor([0]), torch.tensor([1.0]),
                                                       torch.tensor([0.0]), seeds[:1], counters[:1]).tolist()


def test_nan_rows_and_inactive_rows() -> None:
    x = torch.zeros(3, 10_000)
    x[0, 5] = float("inf")   # every probability NaN: the reference's argmax takes its first, as the whole race
    x[1, 3] = 5.0
    filters = (torch.zeros(3, dtype=torch.long), torch.full((3,), 0.9), torch.zeros(3))
    seeds, counters = torch.arange(3), torch.zeros(3, dtype=torch.long)
    want = _reference(x, *filters, seeds, counters)
    assert head_race.filtered_race_head(x, *filters, seeds, counters).tolist() == want.tolist()
    active = torch.tensor([True, False, True])
    got = head_race.filtered_race_head(x, *filters, seeds, counters, active=active)
    assert got.tolist() == [want[0], 0, want[2]]


def test_a_nan_with_its_sign_bit_set_is_raced_as_the_reference_races_it() -> None:
    """x86 makes the NaN 0xFFC00000 (inf - inf): torch's sort puts every NaN first, its bits below -inf."""
    x = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    x[:, :50] += 9
    x[0, 777] = torch.tensor(float("-inf")) + float("inf")
    x[1, 777] = float("nan")
    filters = (torch.tensor([20, 20]), torch.ones(2), torch.zeros(2))
    seeds, counters = torch.tensor([1, 1]), torch.zeros(2, dtype=torch.long)
    want = _reference(x, *filters, seeds, counters)
    assert head_race.filtered_race_head(x, *filters, seeds, counters).tolist() == want.tolist()


def test_noise_at_columns_is_the_whole_rows_noise() -> None:
    seeds, counters = torch.tensor([5, -7, 2**40 + 3]), torch.tensor([0, 9, 2**33])
    whole = exponential_noise_reference(seeds, counters, 5000, 21)
    columns = torch.randint(0, 5000, (3, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(exponential_noise_at(seeds, counters, columns, 21), whole.gather(1, columns))


def test_the_cpu_draw_takes_the_head_race_for_a_wide_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    head = draw.filtered_race_head
    monkeypatch.setattr(draw, "filtered_race_head", lambda x, *a, **kw: calls.append(x.shape[-1]) or head(x, *a, **kw))
    g = torch.Generator().manual_seed(5)
    x = _logits("peaked", 4, g)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    filters = (torch.tensor([0, 0, 5, 0]), torch.tensor([0.9, 0.8, 1.0, 0.95]), torch.zeros(4))
    seeds, counters = torch.arange(4), torch.tensor([3, 4, 5, 6])
    got = draw.draw_tokens_reference(x, temperature, *filters, seeds, counters, 2, True)
    assert calls == [VOCAB]
    scaled = x / torch.tensor([1.0, 0.7, 1.0, 1.3])[:, None]
    want = _reference(scaled, *filters, seeds, counters + 2)
    assert got.tolist() == [int(x[0].argmax())] + want[1:].tolist()


def test_a_whole_rows_order_is_the_stable_sorts() -> None:
    """The order the whole race is handed for rows the head cannot settle: torch's stable descending sort's,
    with ties, -0.0 beside 0.0, infinities, and NaN of either sign (those rows by the sort itself)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 20000, generator=g) * 3).round() / 2   # many equal values
    x[0, :50] = -0.0
    x[0, 50:100] = 0.0
    x[1, ::7] = float("-inf")
    x[2, 3] = float("inf")
    x[3, 9] = float("nan")
    x[4, 11] = torch.tensor(float("-inf")) + float("inf")   # a NaN, by x86 with its sign bit set
    want = x.sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(head_race._descending_order(x), want)
    assert torch.equal(head_race._descending_order(x[[0, 1, 2, 5, 6]]), want[[0, 1, 2, 5, 6]])
    assert torch.equal(head_race._descending_order(x[[3, 4]]), want[[3, 4]])
    one = torch.zeros(3, 1)   # a row of one token: its reversed sort is a view numpy calls contiguous
    assert head_race._descending_order(one).tolist() == [[0]] * 3
