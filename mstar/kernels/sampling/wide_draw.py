"""One draw per row over a vocabulary too wide for a row in registers (a
language model's 150k tokens): a row's logits [B, V], temperature, top-k,
top-p, min-p, seed and counter in, its token ([B] int64) out, as
`draw.draw_tokens_reference` draws it, without a sort and without reading
anything back to the host.

The torch form sorts every row (a radix sort of B x V floats), takes a
softmax and a cumulative sum of the sorted rows, and makes the [B, V] noise
apart: 1.7 ms on an H200 at 64 rows of Orpheus's 157k vocabulary, 5.3 ms at
256 (`scripts/bench_sampler.py`). Here the filters' cuts are found by value
instead of by rank: each scaled logit's float bits, made order-preserving,
are a 32-bit key, and a search over keys finds

- top-k's cut: the largest key with at least k tokens at or above it;
- top-p's cut: the largest key whose tokens at or above it (within top-k)
  hold at least p of the probability.

Tokens above a cut are kept; tokens at it (ties) are kept in index order as a
stable sort would rank them, while the count (top-k) or the mass before them
(top-p) is short. min-p keeps tokens at least min_p times as likely as the
first, and the kept token whose probability over its Exp(1) noise (drawn here,
`noise._exp_noise`) is largest wins. Sums run in another order than torch's
cumsum, so a token whose mass before it lies within a few float32 roundings of
p may be cut on the other side; the tests hold the draws equal otherwise.

Every pass is a launch over (row, block of `block` tokens) programs, so a
row's 157k tokens spread over the GPU at any batch size; a search pass tests
`WAYS` keys at once and a small kernel narrows each row's range, so a 32-bit
key range closes in `PASSES` passes. Per-block partial sums go back through
device tensors only: nothing here waits for the device.

Top-p's search runs only for the rows the candidate descent
(`wide_descent.py`) leaves: it tests race winners against the cut in one pass
each and settles nearly every row in one or two, where the search takes
sixteen passes (eight each testing `WAYS` keys, eight narrowing).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import cdiv, jit, tl
from mstar.kernels.sampling.noise import _INV_2_24, _MUL_A, _MUL_B, _ROW_SALT
from mstar.kernels.sampling.wide_blocks import _block_in, _kept_probs, _race_block, _top_k_kept
from mstar.kernels.sampling.wide_descent import SETTLED, STEPS, descend

BLOCK = 2048        # tokens a program reads
WAYS = 16           # keys a search pass tests at once
PASSES = 8          # WAYS ** PASSES >= 2 ** 32: a range of 32-bit keys closes
# programs a row's search and tie passes take, each looping over every GROUPS-th block: those passes run for
# the few rows the descent leaves, and a (row, block) grid of programs that mostly return at once still
# cost about 70 us a pass at 400 rows on an H200
GROUPS = 8
LOWEST = -(1 << 31)  # below every float's key (only a negative NaN's bits map here)
_NONE = 1 << 40      # "no count limit" for rows without top-k


def draw_tokens_wide(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                     seeds: Tensor, counters: Tensor, offset: int = 0, filtered: bool = True,
                     block: int = BLOCK, top_k_active: bool = True, top_p_active: bool = True,
                     descent_steps: int = STEPS, first: int = 0) -> Tensor:
    """`draw.draw_tokens`'s arguments; `block`: tokens per program (a power
    of two; tests take small ones to cross many blocks). `top_k_active` /
    `top_p_active`: whether any row may cut by top-k / top-p (what the host
    knows of the rows; False skips that search's passes). `descent_steps`:
    candidates a row tests (`wide_descent.py`) before it searches for top-p's
    cut (0: every row searches). `first`: the vocabulary index of column 0
    (the logits a window of the vocabulary: each token draws its id's noise)."""
    rows, vocab = logits.shape
    params = (temperature, top_k, top_p, min_p, seeds, counters)
    if any(p.shape != (rows,) for p in params):
        raise ValueError(f"logits {tuple(logits.shape)} with per-row parameters of {rows} rows")
    if rows == 0 or vocab == 0:
        return torch.zeros(rows, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev, f32, i64 = logits.device, torch.float32, torch.int64
    blocks = cdiv(vocab, block)
    grid = (rows, blocks)
    stride = logits.stride(0)
    temp = temperature.to(f32).contiguous()
    div = torch.where(temp <= 0, torch.ones_like(temp), temp)

    # the raw maximum (greedy: its first index) and the scaled one, rounded as each logit's scaling rounds
    part_max = torch.empty(rows, blocks, dtype=f32, device=dev)
    part_at = torch.empty(rows, blocks, dtype=i64, device=dev)
    _max_kernel[grid](logits, stride, part_max, part_at, vocab, blocks, BLOCK=block, num_warps=4)
    first_block = part_max.argmax(1, keepdim=True)   # the first block holding the maximum
    greedy = part_at.gather(1, first_block).squeeze(1)
    m = part_max.gather(1, first_block).squeeze(1) / div
    m = torch.where(m == 0, torch.zeros_like(m), m)   # -0.0's key is not 0.0's
    bits = m.view(torch.int32).to(i64)
    top = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).contiguous()

    # top-k's cut, the count it still keeps at the cut, and each block's ties before it
    k_cut = torch.full((rows,), LOWEST, dtype=i64, device=dev)
    k_need = torch.full((rows,), _NONE, dtype=i64, device=dev)
    k_before = torch.zeros(rows, blocks, dtype=f32, device=dev)
    keep_k = torch.where(top_k > 0, top_k.to(i64).clamp(max=vocab), vocab)
    total = torch.ones(rows, dtype=f32, device=dev)   # a placeholder until the sum over top-k is known
    kernel_args = (logits, stride, div, m, vocab, blocks)
    top_k_on = filtered and top_k_active   # else every row keeps its whole vocabulary: no scan for top-k's ties
    if top_k_on:
        k_on = keep_k < vocab
        cut = _search(kernel_args, keep_k.to(f32), k_on, top, k_cut, k_need, k_before, total, False, grid, block)
        k_cut = torch.where(k_on, cut, k_cut)
        k_need, k_before = _ties(kernel_args, k_cut, k_need, k_before, total, False, grid, block, keep_k)
        k_need = torch.where(k_on, k_need, _NONE)

    # the softmax's sum over top-k, and the first token at the top (it wins where no score does: a +inf logit
    # leaves every probability NaN, and the torch form takes its rank 0)
    part_total = torch.empty(rows, blocks, dtype=f32, device=dev)
    part_first = torch.empty(rows, blocks, dtype=i64, device=dev)
    _total_kernel[grid](*kernel_args, top, k_cut, k_need, k_before, part_total, part_first, TOP_K=top_k_on,
                        BLOCK=block, num_warps=4)
    total = part_total.sum(1)
    first_top = part_first.amin(1)

    # top-p: most rows settle on a tested candidate; the rest search for the cut, the mass above it, and each
    # block's tied mass before it
    p = top_p.to(f32).contiguous()
    p_cut = torch.full((rows,), LOWEST, dtype=i64, device=dev)
    p_above = torch.zeros(rows, dtype=f32, device=dev)
    p_before = torch.zeros(rows, blocks, dtype=f32, device=dev)
    settled = torch.zeros(rows, dtype=torch.bool, device=dev)
    token = torch.zeros(rows, dtype=i64, device=dev)
    if filtered and top_p_active:
        state, token = descend(kernel_args, k_cut, k_need, k_before, total, p, min_p, seeds, counters, offset,
                               (temp <= 0).to(torch.int8) * SETTLED, grid, block, descent_steps, top_k_on, first)
        settled = state == SETTLED
        p_on = (p < 1.0) & ~settled
        cut = _search(kernel_args, p, p_on, top, k_cut, k_need, k_before, total, True, grid, block, top_k_on)
        p_cut = torch.where(p_on, cut, p_cut)
        p_above, p_before = _ties(kernel_args, p_cut, k_need, k_before, total, True, grid, block, None,
                                  k_cut=k_cut, skip=settled, top_k=top_k_on)

    # the race over the kept tokens of the rows still to draw
    part_win = torch.zeros(rows, blocks, dtype=f32, device=dev)
    part_win_at = torch.zeros(rows, blocks, dtype=i64, device=dev)
    _race_kernel[grid](*kernel_args, k_cut, k_need, k_before, total, p, p_cut, p_above, p_before,
                       min_p.to(f32).contiguous(), seeds.to(i64).contiguous(), counters.to(i64).contiguous(),
                       settled.to(torch.int8), part_win, part_win_at, offset, first, _MUL_A, _MUL_B, _ROW_SALT,
                       _INV_2_24, FILTER=filtered, TOP_K=top_k_on, BLOCK=block, num_warps=4)
    best_block = part_win.argmax(1, keepdim=True)
    win = part_win.gather(1, best_block).squeeze(1)
    # no score (a +inf logit leaves every probability NaN): the torch form's argmax over the NaN row takes its
    # first entry, which is rank 0 (the first top token) when it sorted the row and index 0 when it did not
    fallback = first_top if filtered else torch.zeros_like(first_top)
    drawn = torch.where(win > 0, part_win_at.gather(1, best_block).squeeze(1), fallback)
    return torch.where(temp <= 0, greedy, torch.where(settled, token, drawn))


def _search(kernel_args: tuple, target: Tensor, on: Tensor, top: Tensor, k_cut: Tensor, k_need: Tensor,
            k_before: Tensor, total: Tensor, mass: bool, grid: tuple[int, int], block: int,
            top_k: bool = True) -> Tensor:
    """The largest key whose tokens at or above it reach `target` (a count,
    or with `mass` a probability over top-k's tokens), per row where `on`
    (others: anything). `top_k`: whether any row cuts by top-k."""
    rows, blocks = grid
    lo = torch.full((rows,), LOWEST, dtype=torch.int64, device=top.device)
    hi = top.clone()
    part = torch.empty(rows, GROUPS, WAYS, dtype=torch.float32, device=top.device)
    skip = (~on).to(torch.int8)
    for _ in range(PASSES):
        _above_kernel[(rows, GROUPS)](*kernel_args, lo, hi, skip, k_cut, k_need, k_before, total, part, MASS=mass,
                                      TOP_K=top_k, WAYS=WAYS, GROUPS=GROUPS, BLOCK=block, num_warps=8)
        _narrow_kernel[(rows,)](part, lo, hi, target, skip, WAYS=WAYS, GROUPS=GROUPS, num_warps=1)
    return lo


def _ties(kernel_args: tuple, cut: Tensor, k_need: Tensor, k_before: Tensor, total: Tensor, mass: bool,
          grid: tuple[int, int], block: int, keep: Tensor | None,
          k_cut: Tensor | None = None, skip: Tensor | None = None, top_k: bool = True) -> tuple[Tensor, Tensor]:
    """Above a cut and at it, per block: for top-k (`keep`: the count to
    keep) the count still kept at the cut and each block's ties before it;
    with `mass` (top-p) the mass above the cut and each block's tied mass
    before it. Rows where `skip` come out as zeros."""
    rows, blocks = grid
    above = torch.zeros(rows, blocks, dtype=torch.float32, device=cut.device)
    ties = torch.zeros(rows, blocks, dtype=torch.float32, device=cut.device)
    skip = torch.zeros(rows, dtype=torch.int8, device=cut.device) if skip is None else skip.to(torch.int8)
    _tie_kernel[(rows, GROUPS)](*kernel_args, cut, k_cut if k_cut is not None else cut, k_need, k_before, total, skip,
                                above, ties, MASS=mass, TOP_K=top_k, GROUPS=GROUPS, BLOCK=block, num_warps=4)
    before = ties.cumsum(1) - ties
    if mass:
        return above.sum(1), before
    assert keep is not None
    return keep - above.sum(1).to(torch.int64), before


@jit
def _weighed(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr, k_before_ptr,
             total_ptr, MASS: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Block `blk`'s keys and what each token weighs in a search: 1 (a count),
    or with MASS its probability over top-k's tokens (0 outside them)."""
    if MASS:
        _, key, _, w, _ = _kept_probs(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr,
                                      k_need_ptr, k_before_ptr, total_ptr, TOP_K, BLOCK)
    else:
        _, valid, _, key = _block_in(row, blk, logits_ptr, stride, div_ptr, vocab, BLOCK)
        w = valid.to(tl.float32)
    return key, w


@jit
def _max_kernel(logits_ptr, stride, max_ptr, at_ptr, vocab, blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    tl.store(max_ptr + row * blocks + tl.program_id(1), tl.max(x, axis=0))
    tl.store(at_ptr + row * blocks + tl.program_id(1), tl.argmax(x, axis=0).to(tl.int64) + start)


@jit
def _total_kernel(logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, top_ptr, k_cut_ptr, k_need_ptr, k_before_ptr,
                  total_ptr, first_ptr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx, valid, s, key = _block_in(row, tl.program_id(1), logits_ptr, stride, div_ptr, vocab, BLOCK)
    kept = _top_k_kept(row, tl.program_id(1), blocks, key, valid, k_cut_ptr, k_need_ptr, k_before_ptr, TOP_K)
    e = tl.where(kept, tl.exp(s - tl.load(m_ptr + row)), 0.0)
    at = row * blocks + tl.program_id(1)
    tl.store(total_ptr + at, tl.sum(e, axis=0))
    first = tl.min(tl.where(valid & (key == tl.load(top_ptr + row)), idx, vocab), axis=0)
    tl.store(first_ptr + at, first.to(tl.int64))


@jit
def _above_kernel(logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, lo_ptr, hi_ptr, skip_ptr, k_cut_ptr, k_need_ptr,
                  k_before_ptr, total_ptr, part_ptr, MASS: tl.constexpr, TOP_K: tl.constexpr, WAYS: tl.constexpr,
                  GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """A search pass: for each of the row's WAYS keys (`_probes`), the count
    (or with MASS, the probability over top-k) of the group's tokens at or
    above it (the group: every GROUPS-th block of the row)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(skip_ptr + row) == 0:
        probes = _probes(tl.load(lo_ptr + row), tl.load(hi_ptr + row), WAYS)
        sums = tl.zeros((WAYS,), dtype=tl.float32)
        for blk in range(tl.program_id(1), blocks, GROUPS):
            key, w = _weighed(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr,
                              k_before_ptr, total_ptr, MASS, TOP_K, BLOCK)
            sums += tl.sum(tl.where(key[:, None] >= probes[None, :], w[:, None], 0.0), axis=0)
        tl.store(part_ptr + (row * GROUPS + tl.program_id(1)) * WAYS + tl.arange(0, WAYS), sums)


@jit
def _probes(lo, hi, WAYS: tl.constexpr):
    """The keys a pass tests over [lo, hi]: lo, then WAYS - 1 more spread
    over (lo, hi] (past hi where the range is narrower than WAYS)."""
    j = tl.arange(0, WAYS).to(tl.int64)
    width = hi - lo + 1
    return lo + (j * width + WAYS - 1) // WAYS


@jit(per_row=("target_ptr",))  # top-p's column of an eager draw's parameters starts anywhere
def _narrow_kernel(part_ptr, lo_ptr, hi_ptr, target_ptr, skip_ptr, WAYS: tl.constexpr, GROUPS: tl.constexpr):
    """A row's range after a pass (its GROUPS partial sums per probe): from
    the largest probe whose tokens reach the target (the first, lo, is taken
    to) up to the next probe."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(skip_ptr + row) == 0:
        g = tl.arange(0, GROUPS)
        j = tl.arange(0, WAYS)
        sums = tl.sum(tl.load(part_ptr + (row * GROUPS + g[:, None]) * WAYS + j[None, :]), axis=0)
        lo = tl.load(lo_ptr + row)
        hi = tl.load(hi_ptr + row)
        probes = _probes(lo, hi, WAYS)
        ok = ((sums >= tl.load(target_ptr + row)) & (probes <= hi)) | (j == 0)
        best = tl.max(tl.where(ok, j, 0), axis=0)
        nxt = tl.sum(tl.where(j == best + 1, probes, 0), axis=0)
        tl.store(lo_ptr + row, tl.sum(tl.where(j == best, probes, 0), axis=0))
        tl.store(hi_ptr + row, tl.where(best == WAYS - 1, hi, tl.minimum(nxt - 1, hi)))


@jit
def _tie_kernel(logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, cut_ptr, k_cut_ptr, k_need_ptr, k_before_ptr,
                total_ptr, skip_ptr, above_ptr, ties_ptr, MASS: tl.constexpr, TOP_K: tl.constexpr,
                GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """Each of the group's blocks' count (or with MASS, top-k's probability)
    above a cut and at it."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(skip_ptr + row) == 0:
        cut = tl.load(cut_ptr + row)
        for blk in range(tl.program_id(1), blocks, GROUPS):
            key, w = _weighed(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr,
                              k_before_ptr, total_ptr, MASS, TOP_K, BLOCK)
            at = row * blocks + blk
            tl.store(above_ptr + at, tl.sum(tl.where(key > cut, w, 0.0), axis=0))
            tl.store(ties_ptr + at, tl.sum(tl.where(key == cut, w, 0.0), axis=0))


@jit(per_row=("p_ptr", "min_p_ptr", "seeds_ptr", "counters_ptr"), any_value=("offset", "first"))
def _race_kernel(logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr, k_before_ptr, total_ptr,
                 p_ptr, p_cut_ptr, p_above_ptr, p_before_ptr, min_p_ptr, seeds_ptr, counters_ptr, skip_ptr, win_ptr,
                 win_at_ptr, offset, first, mul_a, mul_b, salt, inv_2_24, FILTER: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK: tl.constexpr):
    """A block's best kept token: its probability over its noise (0 where none
    is kept, or where a NaN probability leaves no order), and where it is;
    nothing for rows that `skip`."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(skip_ptr + row) == 0:
        blk = tl.program_id(1)
        idx, key, kept, probs, total = _kept_probs(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks,
                                                   k_cut_ptr, k_need_ptr, k_before_ptr, total_ptr, TOP_K, BLOCK)
        at = row * blocks + blk
        if FILTER:
            cut = tl.load(p_cut_ptr + row)
            tie = kept & (key == cut)
            tie_probs = tl.where(tie, probs, 0.0)
            before = (tl.load(p_above_ptr + row) + tl.load(p_before_ptr + at) + tl.cumsum(tie_probs, axis=0)
                      - tie_probs)
            # p >= 1 leaves the cut at the lowest key, which no number has: every kept token is above it
            kept = kept & ((key > cut) | (tie & (before < tl.load(p_ptr + row))))
            kept = kept & (probs >= tl.load(min_p_ptr + row) * (1.0 / total))
        # no score anywhere (a +inf logit): the row falls back to its first top token
        _race_block(row, blk, at, idx, kept, probs, tl.load(seeds_ptr + row), tl.load(counters_ptr + row) + offset,
                    first, win_ptr, win_at_ptr, mul_a, mul_b, salt, inv_2_24, BLOCK)
