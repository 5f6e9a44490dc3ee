"""What every pass of the wide-vocabulary draw reads from its block of a
row: the token indices, their temperature-scaled logits, the logits'
order-preserving keys, and which tokens top-k keeps. Shared by the search
(`wide_draw.py`) and the candidate descent (`wide_descent.py`), with the
race's last step: a block's best score and where it is.
"""

from __future__ import annotations

from mstar.kernels.backend import jit, tl
from mstar.kernels.sampling.noise import _exp_noise, _row_key


@jit
def _key(s):
    """Scaled logits' float bits as int64 keys that order as the floats do."""
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 equals 0.0; their bits do not
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@jit
def _scaled(base, idx, valid, div):
    """A block's scaled logits (-inf past the row) and their keys."""
    x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, div)  # rounded as torch's division
    return s, _key(s)


@jit
def _block_in(row, blk, logits_ptr, stride, div_ptr, vocab, BLOCK: tl.constexpr):
    """Block `blk` of a row: its token indices, which are in the row, the
    scaled logits and their keys."""
    idx = blk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < vocab
    s, key = _scaled(logits_ptr + row * stride, idx, valid, tl.load(div_ptr + row))
    return idx, valid, s, key


@jit
def _top_k_kept(row, blk, blocks, key, valid, k_cut_ptr, k_need_ptr, k_before_ptr, TOP_K: tl.constexpr):
    """Top-k's kept tokens of a block: keys above the cut, and ties at it
    while fewer than the count still kept came before them (earlier blocks'
    ties counted in `k_before`). Without TOP_K (no row cuts by it) every
    token in the row, and no scan over the block."""
    if not TOP_K:
        return valid
    cut = tl.load(k_cut_ptr + row)
    tie = valid & (key == cut)
    ties = tie.to(tl.float32)
    before = tl.load(k_before_ptr + row * blocks + blk) + tl.cumsum(ties, axis=0) - ties
    return valid & ((key > cut) | (tie & (before < tl.load(k_need_ptr + row).to(tl.float32))))


@jit
def _kept_probs(row, blk, logits_ptr, stride, div_ptr, m_ptr, vocab, blocks, k_cut_ptr, k_need_ptr, k_before_ptr,
                total_ptr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """A block's indices, keys, top-k's kept tokens and their probabilities
    over top-k (0 for the others), and the row's softmax sum."""
    idx, valid, s, key = _block_in(row, blk, logits_ptr, stride, div_ptr, vocab, BLOCK)
    kept = _top_k_kept(row, blk, blocks, key, valid, k_cut_ptr, k_need_ptr, k_before_ptr, TOP_K)
    total = tl.load(total_ptr + row)
    return idx, key, kept, tl.where(kept, tl.exp(s - tl.load(m_ptr + row)) / total, 0.0), total


@jit
def _race_block(row, blk, at, idx, kept, probs, seed, counter, first, win_ptr, win_at_ptr, mul_a, mul_b, salt,
                inv_2_24, BLOCK: tl.constexpr):
    """Stores the block's best kept token's probability over its Exp(1) noise
    (0 where none is kept, or where a NaN probability, from a +inf logit,
    leaves no order) and its index; the noise is the vocabulary's at `first`
    + index (the logits a window of it)."""
    score = tl.where(kept, probs, 0.0) / _exp_noise(_row_key(seed, counter, mul_a, mul_b, salt), idx + first,
                                                    mul_a, mul_b, inv_2_24)
    score = tl.where(score > 0.0, score, 0.0)
    tl.store(win_ptr + at, tl.max(score, axis=0))
    tl.store(win_at_ptr + at, tl.argmax(score, axis=0).to(tl.int64) + blk * BLOCK)
