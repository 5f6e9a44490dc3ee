"""One draw per row over a vocabulary too wide for a row in registers (a
language model's 150k tokens): a row's logits [B, V], temperature, top-k,
top-p, min-p, seed and counter in, its token ([B] int64) out, as
`draw.draw_tokens_reference` draws it, in one launch and without a sort.

The torch form sorts every row (a radix sort of B x V floats), takes a
softmax and a cumulative sum of the sorted rows, and makes the [B, V] noise
apart: about 1.4 ms of an H200 step at 64 rows of Orpheus's 157k vocabulary.
Here one program streams its row in blocks and finds the filters' cut by
value instead of by rank: each scaled logit's float bits, made
order-preserving, are a 32-bit key, and a bisection over keys finds

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

Not yet what `draw.draw_tokens` runs: it takes over the wide rows once the
H200 has run its tests and timed it against the torch form
(`scripts/gpu_check.sh sampler`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import jit, tl
from mstar.kernels.sampling.noise import _INV_2_24, _MUL_A, _MUL_B, _ROW_SALT, _exp_noise, _row_key

BLOCK = 2048  # elements a program holds at once
CUTS = 33     # bisection steps over a 32-bit key range: enough to close it (a kernel argument: Triton reads
              # no module globals)


def draw_tokens_wide(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                     seeds: Tensor, counters: Tensor, offset: int = 0, filtered: bool = True,
                     block: int = BLOCK) -> Tensor:
    """`draw.draw_tokens`'s arguments; `block`: elements per program step
    (a power of two; tests take small ones to cross many blocks)."""
    rows, vocab = logits.shape
    params = (temperature, top_k, top_p, min_p, seeds, counters)
    if any(p.shape != (rows,) for p in params):
        raise ValueError(f"logits {tuple(logits.shape)} with per-row parameters of {rows} rows")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows and vocab:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        _wide_draw_kernel[(rows,)](logits, logits.stride(0), temperature.float().contiguous(),
                                   top_k.to(torch.int64).contiguous(), top_p.float().contiguous(),
                                   min_p.float().contiguous(), seeds.to(torch.int64).contiguous(),
                                   counters.to(torch.int64).contiguous(), out, vocab, offset, _MUL_A, _MUL_B,
                                   _ROW_SALT, _INV_2_24, FILTER=filtered, BLOCK=block, CUTS=CUTS, num_warps=8)
    return out


@jit
def _scaled(base, idx, valid, div):
    """A block's scaled logits (-inf past the row) and their order-preserving keys (int64)."""
    x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, div)  # rounded as torch's division
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 equals 0.0; their bits do not
    bits = s.to(tl.int32, bitcast=True)
    return s, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@jit
def _in_top_k(key, valid, cut, need, seen):
    """Top-k's kept tokens of a block: keys above the cut, and ties at it
    while fewer than `need` came before them (`seen`: ties of earlier
    blocks). Returns the mask and the ties seen so far."""
    tie = valid & (key == cut)
    ties = tie.to(tl.int32)
    before = seen + tl.cumsum(ties, axis=0) - ties
    return valid & ((key > cut) | (tie & (before < need))), seen + tl.sum(ties, axis=0)


@jit
def _kept(base, idx, vocab, div, cut, need, seen):
    """A block's scaled logits, their keys, and top-k's kept tokens among
    them (`_in_top_k`), with the ties seen so far."""
    valid = idx < vocab
    s, key = _scaled(base, idx, valid, div)
    kept, seen = _in_top_k(key, valid, cut, need, seen)
    return s, key, kept, seen


@jit(per_row=("temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "counters_ptr"),
     any_value=("offset",))
def _wide_draw_kernel(logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, counters_ptr,
                      out_ptr, vocab, offset, mul_a, mul_b, salt, inv_2_24, FILTER: tl.constexpr,
                      BLOCK: tl.constexpr, CUTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    t = tl.load(temp_ptr + row)
    div = tl.where(t <= 0.0, 1.0, t)
    # the raw maximum (greedy: its first index) and the scaled one
    best = tl.full((), float("-inf"), tl.float32)
    best_at = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(x, axis=0)
        at = tl.argmax(x, axis=0).to(tl.int64) + start
        best_at = tl.where(block_best > best, at, best_at)
        best = tl.maximum(best, block_best)
    m = tl.math.div_rn(best, div)
    m = tl.where(m == 0.0, 0.0, m)
    m_bits = m.to(tl.int32, bitcast=True)
    top = tl.where(m_bits >= 0, m_bits, m_bits ^ 0x7FFFFFFF).to(tl.int64)
    lowest = tl.full((), -2147483648, tl.int64)
    # top-k's cut (none: every token at or above the lowest key)
    k_cut = lowest
    k_need = tl.full((), 2147483647, tl.int32)
    if FILTER:
        k = tl.load(top_k_ptr + row)
        keep_k = tl.where(k > 0, tl.minimum(k, vocab), vocab)
        if keep_k < vocab:
            lo, hi = lowest, top
            for _step in range(CUTS):
                mid = lo + (hi - lo + 1) // 2
                count = tl.full((), 0, tl.int64)
                for start in range(0, vocab, BLOCK):
                    idx = start + cols
                    valid = idx < vocab
                    _, key = _scaled(base, idx, valid, div)
                    count += tl.sum((valid & (key >= mid)).to(tl.int64), axis=0)
                at_least = count >= keep_k
                lo = tl.where(at_least, mid, lo)
                hi = tl.where(at_least, hi, mid - 1)
            above = tl.full((), 0, tl.int64)
            for start in range(0, vocab, BLOCK):
                idx = start + cols
                valid = idx < vocab
                _, key = _scaled(base, idx, valid, div)
                above += tl.sum((valid & (key > lo)).to(tl.int64), axis=0)
            k_cut = lo
            k_need = (keep_k - above).to(tl.int32)
    # the softmax's sum over top-k
    # and the first token at the top: it wins where no score does (a +inf logit leaves every probability NaN),
    # as the torch form's rank 0
    total = tl.full((), 0.0, tl.float32)
    first_top = tl.full((), 0, tl.int64)
    first_top = first_top + vocab
    seen = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        s, key, kept, seen = _kept(base, idx, vocab, div, k_cut, k_need, seen)
        total += tl.sum(tl.where(kept, tl.exp(s - m), 0.0), axis=0)
        first_top = tl.minimum(first_top, tl.min(tl.where((idx < vocab) & (key == top), idx, vocab), axis=0).to(tl.int64))
    # top-p's cut, and the mass above it
    p_cut = lowest
    p_above = tl.full((), 0.0, tl.float32)
    p = tl.full((), 2.0, tl.float32)
    if FILTER:
        p = tl.load(top_p_ptr + row)
        if p < 1.0:
            lo, hi = lowest, top
            for _step in range(CUTS):
                mid = lo + (hi - lo + 1) // 2
                mass = tl.full((), 0.0, tl.float32)
                seen = tl.full((), 0, tl.int32)
                for start in range(0, vocab, BLOCK):
                    s, key, kept, seen = _kept(base, start + cols, vocab, div, k_cut, k_need, seen)
                    mass += tl.sum(tl.where(kept & (key >= mid), tl.exp(s - m) / total, 0.0), axis=0)
                enough = mass >= p
                # short: everything at or above mid is above the cut, which lies below it
                p_above = tl.where(enough, p_above, mass)
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            p_cut = lo
    min_p = tl.full((), 0.0, tl.float32)
    if FILTER:
        min_p = tl.load(min_p_ptr + row)
    first = 1.0 / total
    # the race over the kept tokens
    key_row = _row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row) + offset, mul_a, mul_b, salt)
    win = tl.full((), 0.0, tl.float32)
    win_at = first_top
    seen = tl.full((), 0, tl.int32)
    tied_mass = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        s, key, kept, seen = _kept(base, idx, vocab, div, k_cut, k_need, seen)
        probs = tl.where(kept, tl.exp(s - m) / total, 0.0)
        if FILTER:
            tie = kept & (key == p_cut)
            tie_probs = tl.where(tie, probs, 0.0)
            before = p_above + tied_mass + tl.cumsum(tie_probs, axis=0) - tie_probs
            # p >= 1 leaves the cut at the lowest key, which no number has: every kept token is above it
            kept = kept & ((key > p_cut) | (tie & (before < p)))
            tied_mass += tl.sum(tie_probs, axis=0)
            kept = kept & (probs >= min_p * first)
        score = tl.where(kept, probs, 0.0) / _exp_noise(key_row, idx, mul_a, mul_b, inv_2_24)
        block_win = tl.max(score, axis=0)
        at = tl.argmax(score, axis=0).to(tl.int64) + start
        win_at = tl.where(block_win > win, at, win_at)
        win = tl.maximum(win, block_win)
    tl.store(out_ptr + row, tl.where(t <= 0.0, best_at, win_at))
