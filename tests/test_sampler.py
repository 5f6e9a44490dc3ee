"""Sampler: greedy rows, batch-independent seeded draws, the filters, the
repetition penalty, and the counter-based hash behind the noise."""

from __future__ import annotations

import random

import pytest
import torch

from mstar.engine.execution.sampler import SamplingTensors, banned_mask, banned_table, sample
from mstar.kernels.sampling.noise import exponential_noise_reference, random_bits
from mstar.kernels.sampling.penalty import repetition_penalty
from mstar.types import SamplingParams

M32 = 0xFFFFFFFF


def _py_mix32(x: int) -> int:
    """The sampler's mix, written with unbounded Python ints as a reference."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def _py_bits(seed: int, counter: int, v: int) -> int:
    seed &= (1 << 64) - 1  # the int64 bit pattern, as torch sees a negative seed
    key = _py_mix32((seed & M32) ^ 0x3C6EF372)
    key = _py_mix32(key ^ (seed >> 32))
    key = _py_mix32(key ^ (counter & M32))
    key = _py_mix32(key ^ ((counter >> 32) & M32))
    return _py_mix32(key ^ _py_mix32(v))


def _tensors(params: list[SamplingParams], seeds: list[int], counters: list[int] | None = None) -> SamplingTensors:
    return SamplingTensors.build(params, seeds, counters or [0] * len(params), "cpu")


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """One draw for each of n seeds, as counts per vocab index."""
    st = _tensors([params] * n, list(range(n)))
    tokens = sample(logits_row.expand(n, -1).contiguous(), st)
    return torch.bincount(tokens, minlength=logits_row.shape[-1])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


def test_hash_matches_python_reference() -> None:
    rng = random.Random(7)
    cases = [(0, 0), (1, 0), (2**63 - 1, 2**32 - 1), (2**32, 2**32 + 5), (-1, 3), (-(2**63), 1)]
    cases += [(rng.randrange(-(2**63), 2**63), rng.randrange(0, 2**40)) for _ in range(20)]
    vocab = 300
    seeds = torch.tensor([s for s, _ in cases], dtype=torch.int64)
    counters = torch.tensor([c for _, c in cases], dtype=torch.int64)
    bits = random_bits(seeds, counters, vocab)
    assert bits.min() >= 0 and bits.max() <= M32
    for row, (s, c) in enumerate(cases):
        for v in (0, 1, 2, 17, vocab - 1):
            assert int(bits[row, v]) == _py_bits(s, c, v), (s, c, v)


def test_cpu_noise_is_the_int64_forms_bits() -> None:
    """The CPU's noise, mixed in numpy's uint32, is the torch int64 form's, bit for bit; so is its draw at
    chosen columns."""
    from mstar.kernels.sampling.noise import _exp_of_bits, _mix_at, exponential_noise_at, row_keys

    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 2**32 + 5, 123456789], dtype=torch.int64)
    counters = torch.tensor([0, 2**32 - 1, 2**32, 7, 2**40 + 3, 1, 99], dtype=torch.int64)
    for vocab, first in ((300, 0), (5000, 17), (1, 2**31 - 2)):
        want = _exp_of_bits(random_bits(seeds, counters, vocab, first) >> 8)
        got = exponential_noise_reference(seeds, counters, vocab, first)
        assert got.dtype == torch.float32 and torch.equal(got, want), (vocab, first)
        columns = torch.randint(0, vocab, (len(seeds), 9), generator=torch.Generator().manual_seed(vocab))
        assert torch.equal(exponential_noise_at(seeds, counters, columns, first), want.gather(1, columns))
        # the form other devices take, in torch's int64 ops
        keys = row_keys(seeds, counters)
        assert torch.equal(_exp_of_bits(_mix_at(keys, columns + first) >> 8), want.gather(1, columns))
    assert exponential_noise_reference(seeds[:0], counters[:0], 10).shape == (0, 10)


def test_hash_bits_look_uniform() -> None:
    bits = random_bits(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    # Each bit position is set about half the time over 262144 draws.
    per_bit = torch.stack([(bits >> b) & 1 for b in range(32)]).float().mean(dim=(1, 2))
    assert torch.all((per_bit - 0.5).abs() < 0.01)


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    st = _tensors([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 6, [1] * 6)
    assert st.all_greedy
    assert torch.equal(sample(logits, st), logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 40)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = sample(logits, _tensors(params, [3, 4, 5, 6]))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.01)])
def test_draw_depends_only_on_seed_and_counter(params: SamplingParams) -> None:
    torch.manual_seed(2)
    target = torch.randn(1, 100)
    alone = sample(target, _tensors([params], [1234], [9]))
    others = torch.randn(4, 100)
    batch = torch.cat([others[:2], target, others[2:]])
    seeds, counters = [11, 12, 1234, 13, 14], [0, 5, 9, 2, 7]
    mixed = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), params,
             SamplingParams(), SamplingParams(top_p=0.3)]
    together = sample(batch, _tensors(mixed, seeds, counters))
    assert together[2] == alone[0]
    reversed_order = sample(batch.flip(0), _tensors(mixed[::-1], seeds[::-1], counters[::-1]))
    assert torch.equal(reversed_order.flip(0), together)


def test_counters_change_the_draw() -> None:
    logits = torch.zeros(64, 1000)  # uniform: any change of noise shows
    same_seed = [SamplingParams()] * 64
    draws = sample(logits, _tensors(same_seed, [42] * 64, list(range(64))))
    assert len(set(draws.tolist())) > 50
    again = sample(logits, _tensors(same_seed, [42] * 64, list(range(64))))
    assert torch.equal(draws, again)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    counts = _draw_many(logits, SamplingParams(temperature=temperature), 20_000)
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    # df = 4; the 99.99% quantile is ~23.5. Seeds are fixed, so this is deterministic.
    assert _chi_square(counts.float(), probs) < 23.5


def test_top_k_distribution_is_renormalised() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -3.0]])
    counts = _draw_many(logits, SamplingParams(top_k=3), 20_000)
    expected = torch.softmax(logits[0].masked_fill(logits[0] < 0.5, float("-inf")), dim=-1)
    assert counts[expected == 0].sum() == 0
    assert _chi_square(counts.float(), expected) < 20.0  # df = 2


def _naive_allowed(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Which tokens may be drawn, computed one token at a time."""
    probs = torch.softmax(row / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    total = sum(probs[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += probs[i] / total
        if mass >= p.top_p:
            break
    top = probs[kept[0]]
    return {i for i in kept if probs[i] >= p.min_p * top}


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=4),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
])
def test_filters_never_pick_filtered_tokens(params: SamplingParams) -> None:
    torch.manual_seed(3)
    n = 400
    logits = torch.randn(n, 32) * 2
    tokens = sample(logits, _tensors([params] * n, list(range(n))))
    for row, token in enumerate(tokens.tolist()):
        assert token in _naive_allowed(logits[row], params), row
    assert len(set(tokens.tolist())) > 1  # the draws are not all the argmax


def test_top_p_keeps_the_top_token_when_it_alone_reaches_p() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    tokens = sample(logits.expand(100, -1), _tensors([SamplingParams(top_p=0.5)] * 100, list(range(100))))
    assert torch.all(tokens == 0)


def test_repetition_penalty_matches_naive_loop() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 20)
    seen = torch.rand(3, 20) < 0.4
    penalty = torch.tensor([1.0, 1.3, 2.0])
    expected = logits.clone()
    for b in range(3):
        for v in range(20):
            if seen[b, v]:
                x = expected[b, v]
                expected[b, v] = x / penalty[b] if x > 0 else x * penalty[b]
    assert torch.allclose(repetition_penalty(logits, seen, penalty), expected)


def test_penalty_steers_greedy_and_needs_a_seen_mask() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0]])
    st = _tensors([SamplingParams(temperature=0.0, repetition_penalty=2.0)], [0])
    assert st.any_penalty
    assert sample(logits, st, seen=torch.tensor([[True, False, False]])).item() == 1
    with pytest.raises(ValueError):
        sample(logits, st)


def test_build_flags() -> None:
    st = _tensors([SamplingParams(temperature=0.0, top_k=5), SamplingParams()], [0, 1])
    assert not st.all_greedy and not st.any_penalty
    assert not st.any_filter  # the filtered row is greedy: filters would be wasted work
    assert st.top_k.dtype == torch.int64 and st.temperature.dtype == torch.float32
    with pytest.raises(ValueError):
        SamplingTensors.build([SamplingParams()], [0, 1], [0], "cpu")


# seed 0, draw 18735: the noise's 32-bit value at index 622 has its top 24 bits all ones, where
# (2**24 - 1 + 0.5) / 2**24 rounds to 1.0 in float32 and the draw was -log(1) = -0.0
_TOP_SEED, _TOP_DRAW, _TOP_INDEX = 0, 18735, 622


def test_the_top_random_value_still_draws_a_positive_noise() -> None:
    seeds, draws = torch.tensor([_TOP_SEED]), torch.tensor([_TOP_DRAW])
    assert int(random_bits(seeds, draws, 1088)[0, _TOP_INDEX]) >> 8 == 2**24 - 1
    assert (exponential_noise_reference(seeds, draws, 1088) > 0).all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=50),
                                    SamplingParams(temperature=1.0, top_k=0, top_p=1.0)], ids=["filtered", "plain"])
def test_a_masked_token_is_never_drawn_even_at_the_top_random_value(params: SamplingParams) -> None:
    """The talker's logits mask most of its vocabulary with -inf: with the
    top random value on a masked index, the race drew it (a NaN wins argmax)."""
    logits = torch.full((1, 1088), float("-inf"))
    logits[0, :64] = torch.randn(64, generator=torch.Generator().manual_seed(0))
    st = SamplingTensors.build([params], [_TOP_SEED], [_TOP_DRAW], "cpu")
    assert int(sample(logits, st)) < 64


def test_banned_ids_are_never_drawn_and_pads_ban_nothing() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [0.0, 1.0, 9.0, 2.0], [7.0, 1.0, 0.0, 0.0]])
    banned = torch.tensor([[0, -1], [2, 1], [-1, -1]])  # row 0: its argmax; row 1: its best two; row 2: nothing
    greedy = SamplingTensors.build([SamplingParams(temperature=0.0)] * 3, [0] * 3, [0] * 3, "cpu")
    assert sample(logits, greedy, banned=banned).tolist() == [1, 3, 0]
    hot = SamplingTensors.build([SamplingParams(temperature=5.0)] * 3, [1, 2, 3], [0] * 3, "cpu")
    for counter in range(200):
        hot.counters.fill_(counter)
        drawn = sample(logits, hot, banned=banned).tolist()
        assert drawn[0] != 0 and drawn[1] not in (1, 2)
    past = torch.tensor([[999_999, 0], [2**31 - 1, -1], [4, 1]])  # ids past the vocabulary ban nothing
    assert banned_mask(past, 4).tolist() == [[True, False, False, False], [False] * 4, [False, True, False, False]]
    assert sample(logits, greedy, banned=past).tolist() == [1, 2, 0]
    assert banned_table([(), ()], "cpu") is None
    assert banned_table([(3,), (), (4, 5)], "cpu").tolist() == [[3, -1], [-1, -1], [4, 5]]


def test_picked_rows_get_their_own_flags_from_the_host() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0, top_k=5)]
    st = SamplingTensors.build(params, [1, 2, 3, 4], [0, 0, 0, 0], "cpu")
    assert not st.all_greedy and st.any_penalty and st.any_filter
    both = st.cat(SamplingTensors.build(params[:1], [5], [0], "cpu"))

    def pick(s: SamplingTensors, rows: list[int]) -> SamplingTensors:
        idx = torch.tensor(rows)
        return s.select(idx, idx)

    assert st.any_top_p and not st.any_top_k  # the top_k=5 row is greedy: it cuts nothing
    greedy = pick(both, [0, 3, 4])  # top_k of a greedy row filters nothing
    assert greedy.all_greedy and not greedy.any_penalty and not greedy.any_filter
    assert not greedy.any_top_k and not greedy.any_top_p
    assert greedy.temperature.tolist() == [0.0, 0.0, 0.0]
    sampled = pick(both, [1, 2])
    assert not sampled.all_greedy and sampled.any_penalty and sampled.any_filter and sampled.any_top_p
    cut_by_k = SamplingTensors.build([SamplingParams(temperature=0.5, top_k=3)], [1], [0], "cpu")
    assert cut_by_k.any_top_k and not cut_by_k.any_top_p
    assert pick(cut_by_k.cat(st), [0]).any_top_k and not pick(cut_by_k.cat(st), [1, 2]).any_top_k
    # without the host's flags (a graph's bound draws) picked rows keep the flags they had
    kept = pick(SamplingTensors(**{**st.__dict__, "host_flags": None}), [0])
    assert not kept.all_greedy and kept.any_penalty and kept.any_filter
