"""Candidate descent: most rows of a filtered wide-vocabulary draw find
their token without a search for top-p's cut. Per row: the scaled logits
(as `wide_draw` prepared them: the maximum, the softmax's sum over top-k,
top-k's cut), top-p, min-p, seed and counter in; whether the row settled
and its token out.

The draw is the kept token whose probability over its Exp(1) noise is
largest, and top-p keeps a prefix of the tokens in descending order (key,
then index). So a race over every token that top-k and min-p keep is run
first: if its winner c lies in top-p's prefix (the mass of the tokens
before c is short of p), c is the draw, having won over a field that holds
every kept token. If it does not, every kept token comes before c, so the
race runs again over the tokens before c, and its winner is tested as c
was. One pass over the row both tests a candidate and races the tokens
before it.

A candidate fails about as often as the mass top-p cuts is drawn (1 - p at
most, the first time), so a few passes settle nearly every row; the rest
(and rows with no score, such as a +inf logit's NaN probabilities) take
the search. Settled rows skip every later pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import block_size, jit, tl
from mstar.kernels.sampling.noise import _INV_2_24, _MUL_A, _MUL_B, _ROW_SALT
from mstar.kernels.sampling.wide_blocks import _key, _kept_probs, _race_block

STEPS = 4  # candidates tested before a row takes the search

DESCENDING, SETTLED, STUCK = 0, 1, 2  # a row's state


def descend(kernel_args: tuple, k_cut: Tensor, k_need: Tensor, k_before: Tensor, total: Tensor, p: Tensor,
            min_p: Tensor, seeds: Tensor, counters: Tensor, offset: int, state: Tensor, grid: tuple[int, int],
            block: int, steps: int = STEPS, top_k: bool = True, first: int = 0) -> tuple[Tensor, Tensor]:
    """`kernel_args` and the top-k tensors as `wide_draw` passes them to its
    kernels; `state` [rows] int8: SETTLED for rows that need no draw here
    (greedy ones), DESCENDING for the rest; `top_k`: whether any row cuts by
    top-k; `first`: the vocabulary index of column 0 (its noise). Returns
    (state, token): token is the draw where state is SETTLED (and was not
    settled on entry), else meaningless."""
    rows, blocks = grid
    dev = total.device
    part_mass = torch.zeros(rows, blocks, dtype=torch.float32, device=dev)
    part_win = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    part_at = torch.empty(rows, blocks, dtype=torch.int64, device=dev)
    token = torch.zeros(rows, dtype=torch.int64, device=dev)
    state = state.to(torch.int8).contiguous()
    row_args = (min_p.to(torch.float32).contiguous(), seeds.to(torch.int64).contiguous(),
                counters.to(torch.int64).contiguous())
    for step in range(steps + 1):
        opening, closing = step == 0, step == steps
        _descend_kernel[grid](*kernel_args, k_cut, k_need, k_before, total, *row_args, token, state, part_mass,
                              part_win, part_at, offset, first, _MUL_A, _MUL_B, _ROW_SALT, _INV_2_24, FIRST=opening,
                              LAST=closing, TOP_K=top_k, BLOCK=block, num_warps=4)
        _settle_kernel[(rows,)](p, token, state, part_mass, part_win, part_at, blocks, FIRST=opening, LAST=closing,
                                BLOCKS=block_size(blocks), num_warps=1)
    return state, token


@jit(per_row=("min_p_ptr", "seeds_ptr", "counters_ptr"), any_value=("offset", "first"))
def _descend_kernel(logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr, k_before_ptr,
                    total_ptr, min_p_ptr, seeds_ptr, counters_ptr, cand_ptr, state_ptr, mass_ptr, win_ptr, win_at_ptr,
                    offset, first, mul_a, mul_b, salt, inv_2_24, FIRST: tl.constexpr, LAST: tl.constexpr,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """A block's part of a step: the probability of top-k's tokens before the
    row's candidate (past the first step), and the best score among the kept
    tokens before it (all of them, the first step)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + row) == 0:
        blk = tl.program_id(1)
        idx, key, kept, probs, total = _kept_probs(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks,
                                                   k_cut_ptr, k_need_ptr, k_before_ptr, total_ptr, TOP_K, BLOCK)
        at = row * blocks + blk
        if not FIRST:
            cand = tl.load(cand_ptr + row)
            c = tl.math.div_rn(tl.load(logits_ptr + row * stride + cand).to(tl.float32), tl.load(div_ptr + row))
            c_key = _key(c)
            kept = kept & ((key > c_key) | ((key == c_key) & (idx < cand)))
            tl.store(mass_ptr + at, tl.sum(tl.where(kept, probs, 0.0), axis=0))
        if not LAST:
            kept = kept & (probs >= tl.load(min_p_ptr + row) * (1.0 / total))
            _race_block(row, blk, at, idx, kept, probs, tl.load(seeds_ptr + row), tl.load(counters_ptr + row) + offset,
                        first, win_ptr, win_at_ptr, mul_a, mul_b, salt, inv_2_24, BLOCK)


@jit(per_row=("p_ptr",))
def _settle_kernel(p_ptr, cand_ptr, state_ptr, mass_ptr, win_ptr, win_at_ptr, blocks, FIRST: tl.constexpr,
                   LAST: tl.constexpr, BLOCKS: tl.constexpr):
    """A row after a step: settled on its candidate when the mass before it
    is short of p; otherwise on to the best token before it, or stuck (to
    the search) when none scores or the steps are spent."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + row) == 0:
        b = tl.arange(0, BLOCKS)
        at = row * blocks + b
        inside = b < blocks
        if FIRST:
            passed = False
        else:
            p = tl.load(p_ptr + row)
            passed = (tl.sum(tl.load(mass_ptr + at, mask=inside, other=0.0), axis=0) < p) | (p >= 1.0)
        if LAST:
            state = tl.where(passed, 1, 2)
        else:
            win = tl.load(win_ptr + at, mask=inside, other=0.0)
            best = tl.argmax(win, axis=0)
            best_at = tl.sum(tl.where(b == best, tl.load(win_at_ptr + at, mask=inside, other=0), 0), axis=0)
            state = tl.where(passed, 1, tl.where(tl.max(win, axis=0) > 0.0, 0, 2))
            tl.store(cand_ptr + row, tl.where(passed, tl.load(cand_ptr + row), best_at))
        tl.store(state_ptr + row, state.to(tl.int8))
