"""The filtered race (`race.filtered_race_reference`) over a wide vocabulary
on the CPU, sorting only the head of each row: the scaled float32 logits [B, V],
the filters and the rows' noise keys in; the reference's tokens [B] out.

The reference sorts every row whole (~8 ms a row of Orpheus's 157k ids on
one core) to find the tokens top-k, top-p and min-p keep, most often a few
hundred. Here each row's softmax is taken in vocabulary order, as the
reference takes it (`race.kept_softmax`); a bound on the tokens the filters
keep is read from it (`_head_size`); only that head is found (a partition) and
sorted, by value then index, as the reference's stable sort orders it. A
cumulative sum is a sequential scan, so the head's sums are the prefix of
the reference's, and every keep or cut inside the head is the reference's,
bit for bit; the noise is drawn at the head's ids only. A row whose head
cannot be shown to hold every kept token (a loose bound, ties across its
end, NaN probabilities) is raced by the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mstar.kernels.sampling.noise import exponential_noise_at, exponential_noise_reference
from mstar.kernels.sampling.race import filtered_race_reference

HEAD_MIN_VOCAB = 8192   # narrower rows sort whole in about the time this form's passes take
# A cut by top-p at the head's last token holds for every later token only if that token's probability
# outweighs the rounding of the sums around it (a few float32 ulps of a mass near 1): see `_settled`.
SETTLED_MASS = 1e-6
FLOOR_MARGIN = 1e-5     # relative: see `_settled`
BINS_PER_OCTAVE = 8     # the head's bound reads the probabilities in bins of 2^(1/8)
OCTAVES = 150           # past float32's smallest normal probability: one bin holds the rest
HEAD_SLACK = 16         # tokens beyond the bound, for a cut that falls a token later than the bins say
MAX_HEAD_SHARE = 4      # a head past 1/4 of the row: the whole sort is as cheap


def filtered_race_head(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, seeds: Tensor,
                       counters: Tensor, first: int = 0, active: Tensor | None = None) -> Tensor:
    """`filtered_race_reference(scaled, top_k, top_p, min_p, noise)` with the noise of `seeds` and `counters`
    (`exponential_noise_reference` from vocabulary index `first`); rows not `active` get token 0 without a
    race (a greedy row's draw is discarded)."""
    rows, vocab = scaled.shape
    out = torch.zeros(rows, dtype=torch.long)
    todo = torch.arange(rows) if active is None else active.nonzero().squeeze(1)
    if todo.numel() == 0:
        return out
    x = scaled if todo.numel() == rows else scaled[todo]   # every row: no copy
    k = torch.where(top_k[todo] > 0, top_k[todo].clamp(max=vocab), vocab)
    p, floor = top_p[todo], min_p[todo]
    whole = k >= vocab
    probs = torch.softmax(x, dim=-1)   # the reference's, for every row top-k leaves whole
    bound = k.clone()   # top-k bounds its rows; the softmax bounds the rest
    if bool(whole.any()):
        bound[whole] = _head_size(probs[whole], p[whole], floor[whole])
    head = torch.where(bound + 1 + HEAD_SLACK <= vocab // MAX_HEAD_SHARE, bound, -1)
    settled = torch.zeros(todo.numel(), dtype=torch.bool)
    near = (head >= 0).nonzero().squeeze(1)
    if near.numel():
        size = int(head[near].max()) + 1 + HEAD_SLACK
        tokens, ok = _race_heads(x[near], k[near], p[near], floor[near], probs[near], whole[near], size,
                                 seeds[todo[near]], counters[todo[near]], first)
        out[todo[near[ok]]] = tokens[ok]
        settled[near[ok]] = True
    left = (~settled).nonzero().squeeze(1)
    if left.numel():
        rest = todo[left]
        noise = exponential_noise_reference(seeds[rest], counters[rest], vocab, first)
        xr = scaled[rest]
        out[rest] = filtered_race_reference(xr, top_k[rest], top_p[rest], min_p[rest], noise, _descending_order(xr),
                                            probs[left])
    return out


def _head_size(probs: Tensor, p: Tensor, floor: Tensor) -> Tensor:
    """A bound [B] on the tokens top-p (`p`) and min-p (`floor`) keep of rows `probs` [B, V] (top-k left
    them whole): min-p's count exactly; top-p's as every token in the bins of 2^(1/8) down to the one where
    the mass reaches p. The row's length where neither filters."""
    rows, vocab = probs.shape
    bound = torch.full((rows,), vocab, dtype=torch.long)
    if bool((floor > 0).any()):
        kept = (probs >= floor[:, None] * probs.amax(dim=-1, keepdim=True)).sum(dim=-1)
        bound = torch.where(floor > 0, kept, bound)
    if bool((p < 1).any()):
        nbins = OCTAVES * BINS_PER_OCTAVE
        # in place, each pass over the row once: a zero probability's +inf to the last bin, NaN to the first
        bins = torch.log2(probs).mul_(-BINS_PER_OCTAVE).clamp_(0, nbins - 1).nan_to_num_(nan=0.0).long()
        mass = torch.zeros(rows, nbins, dtype=probs.dtype).scatter_add_(1, bins, probs).cumsum_(dim=-1)
        # the first bin whose mass, with every bin above it, reaches p (none: the whole row)
        reached = mass >= p[:, None]
        crossing = torch.where(reached.any(dim=-1), reached.long().argmax(dim=-1), nbins - 1)
        upto = (bins <= crossing[:, None]).sum(dim=-1)
        bound = torch.where(p < 1, torch.minimum(bound, upto), bound)
    return bound


def _race_heads(x: Tensor, k: Tensor, p: Tensor, floor: Tensor, probs: Tensor, whole: Tensor, size: int,
                seeds: Tensor, counters: Tensor, first: int) -> tuple[Tensor, Tensor]:
    """The race over each row's `size` largest logits: (tokens [B], which rows it settled [B])."""
    ids, vals = _sorted_head(x, size)
    rank = torch.arange(size)
    # exact: the first r tokens are the reference's first r, in its order, where the r-th is larger than the next
    steps = vals[:, :-1] > vals[:, 1:]
    exact = torch.where(steps, rank[1:], 0).amax(dim=-1)
    if not bool(whole.all()):   # top-k's rows: the softmax over their k tokens, found exact in the head
        in_k = torch.zeros_like(x, dtype=torch.bool).scatter_(1, ids, rank < torch.minimum(k, exact)[:, None])
        probs = torch.where(whole[:, None], probs, torch.softmax(x.masked_fill(~in_k, float("-inf")), dim=-1))
    weights = probs.gather(1, ids)
    mass_before = weights.cumsum(dim=-1) - weights
    keep = (rank < k[:, None]) & (rank < exact[:, None]) & ((mass_before < p[:, None]) | (p[:, None] >= 1.0))
    keep &= weights >= floor[:, None] * weights[:, :1]
    # a top-k row's softmax is the reference's only where its k tokens were all exact
    # a NaN logit (one with its sign bit set sorts below -inf by its bits, where torch's sort puts every NaN
    # first) and NaN probabilities: the reference's. A row's sum is NaN where any of it is (one pass, where
    # isnan and any take two); a sum of +inf and -inf sends a row without NaN there too, which is only slower
    ok = (_settled(exact, k, p, floor, weights, mass_before) & (whole | (k <= exact))
          & ~probs.sum(dim=-1).isnan() & ~x.sum(dim=-1).isnan())
    noise = exponential_noise_at(seeds, counters, ids, first)
    winner = torch.argmax(weights.masked_fill(~keep, 0.0) / noise, dim=-1, keepdim=True)
    return ids.gather(1, winner).squeeze(1), ok


def _sorted_head(x: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The `size` largest logits of each row [B, size] as the reference's stable descending sort orders them
    (equal values by index), and their ids."""
    ids = _head_ids(x, size)
    ids = _by_value_then_index(x.gather(1, ids), ids)
    return ids, x.gather(1, ids)


def _by_value_then_index(vals: Tensor, ids: Tensor) -> Tensor:
    """`ids` [B, n] (float32 `vals` [B, n] at them, no NaN) in the order the reference's stable descending
    sort puts them: by value, equal values by index. One sort of a key that holds both, a float's bits made
    order-preserving above the index's complement; a row's keys are distinct, so any sort orders them alike,
    and numpy's sorts int64 keys ~5x faster than torch's sort."""
    vals = torch.where(vals == 0, 0.0, vals)   # -0.0 sorts with 0.0, as torch's sort compares them
    bits = vals.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    key = (ordered << 32) + (0x7FFFFFFF - ids)
    key = torch.from_numpy(np.sort(key.numpy(), axis=-1)[:, ::-1].copy())   # copy: positive strides
    return 0x7FFFFFFF - (key & 0xFFFFFFFF)


def _descending_order(x: Tensor) -> Tensor:
    """The order [B, V] the reference's stable descending sort gives each whole row of `x`: by the int64 keys
    where a row has no NaN (one with its sign bit set orders otherwise by its bits), else by that sort itself."""
    nan = x.isnan().any(dim=-1)
    if bool(nan.all()):
        return x.sort(dim=-1, descending=True, stable=True).indices
    order = torch.empty(x.shape, dtype=torch.long)
    fine = ~nan
    order[fine] = _by_value_then_index(x[fine], torch.arange(x.shape[-1]).expand(int(fine.sum()), -1))
    if bool(nan.any()):
        order[nan] = x[nan].sort(dim=-1, descending=True, stable=True).indices
    return order


def _head_ids(x: Tensor, size: int) -> Tensor:
    """Ids of each row's `size` largest logits, in no order; which of a run of equal logits across the end
    it takes is unspecified (the exact prefix, `_race_heads`, does not depend on it). numpy's partition finds
    a head of tens of thousands ~3x faster than torch's topk."""
    cut = x.shape[-1] - size
    return torch.from_numpy(np.ascontiguousarray(np.argpartition(x.detach().numpy(), cut, axis=-1)[:, cut:]))


def _settled(exact: Tensor, k: Tensor, p: Tensor, floor: Tensor, weights: Tensor, mass_before: Tensor) -> Tensor:
    """Rows whose filters cut every token from the head's exact end on, so the head holds all they keep:
    top-k within it; min-p already below its floor at the last exact token (probabilities only fall); or
    top-p reached before it, by a token heavy enough that the later sums, each rounded, cannot fall back
    under p (`SETTLED_MASS`)."""
    last = (exact - 1).clamp(min=0)[:, None]
    at_last = weights.gather(1, last).squeeze(1)
    by_k = k <= exact
    # with a margin of a few ulps: nothing promises that float exp never rises by one as its argument falls
    by_floor = (floor > 0) & (at_last * (1 + FLOOR_MARGIN) < floor * weights[:, 0])
    by_p = (p < 1) & (mass_before.gather(1, last).squeeze(1) >= p) & (at_last >= SETTLED_MASS)
    return (exact > 0) & (by_k | by_floor | by_p)
