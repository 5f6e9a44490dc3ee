"""The sampler's filtered race: each row's temperature-scaled logits [B, V],
its top-k, top-p and min-p, and its Exp(1) noise [B, V] in; the token that
wins out ([B] int64). The logits are sorted, top-k keeps the first k,
top-p the smallest prefix whose mass before each kept token is short of p,
min-p the tokens at least min_p times as likely as the first, and the kept
token whose probability over its noise is largest wins (equivalent to
sampling from the filtered softmax).

The torch form (`filtered_race_reference`) is about thirty launches (sort,
softmax, cumsum, masks, gathers); a code predictor draws fifteen times a
frame, one after another. For vocabularies up to `MAX_VOCAB` the draw
kernel (`draw.py`) filters a row in one program (`_sorted_weights`): its
logits sorted in registers (each float's bits made order-preserving,
with the index below them, so equal logits keep index order as a stable
sort does), then the filters and the race. Its softmax and cumsum round
within a few ulps of torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import jit, tl

MAX_VOCAB = 4096  # a row's sort stays in registers


def filtered_race_reference(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, noise: Tensor,
                            order: Tensor | None = None, softmax: Tensor | None = None) -> Tensor:
    """Top-k, then top-p over the survivors, then min-p; race in sorted order. Where the caller found them
    another way (the CPU's `head_race`): `order`, the rows' stable descending sort's indices; `softmax`, the
    rows' softmax over the whole vocabulary, which is their kept softmax where top-k keeps every token."""
    vocab = scaled.shape[-1]
    if order is None:
        _, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    keep = rank < k[:, None]
    if softmax is None:
        kept = kept_softmax(scaled, keep, order)
    else:  # masking nothing leaves the same bits; the rows top-k cuts take theirs
        kept = softmax
        cut = (k < vocab).nonzero().squeeze(1)
        if cut.numel():
            kept = softmax.clone()
            kept[cut] = kept_softmax(scaled[cut], keep[cut], order[cut])
    probs = kept.gather(1, order)
    # Keep a token while the mass before it is short of p: the smallest set
    # reaching p, and never empty since the first token has nothing before it.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # The row's scale of the weights does not change the argmax: no renormalising.
    weights = probs.masked_fill(~keep, 0.0)
    winner = torch.argmax(weights / noise.gather(1, order), dim=-1, keepdim=True)
    return order.gather(1, winner).squeeze(1)


def kept_softmax(scaled: Tensor, keep: Tensor, order: Tensor) -> Tensor:
    """The softmax of each row over the tokens `keep` (in sorted order, as
    `order` sorts the row) holds, in vocabulary order: summed in that order,
    whatever sorted the row, so a form that sorts only a row's head
    (`head_race.py`) gets the same bits. No branch on the values: a CUDA
    graph captures it (the sampler's)."""
    kept = torch.zeros_like(keep).scatter_(1, order, keep)
    return torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)


@jit
def _sorted_weights(x, k, p, min_p, vocab, BLOCK: tl.constexpr):
    """A row's float32 logits x [BLOCK] (-inf past the vocabulary) and its
    filters -> (the kept tokens' probabilities in descending logit order, 0
    where filtered out; the token at each rank)."""
    rank = tl.arange(0, BLOCK)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 equals 0.0 (a sort keeps their index order); their bits do not
    # a float's bits as an int32 that orders as the floats do, the index below them (reversed, so that a
    # descending sort puts the lower index first among equal logits)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) + (BLOCK - 1 - rank).to(tl.int64)  # the low word is free: + is |
    key = tl.sort(key, descending=True)
    high = key >> 32
    index = BLOCK - 1 - (key - (high << 32))
    back = high.to(tl.int32)
    v = tl.where(back >= 0, back, back ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    k = tl.where(k > 0, tl.minimum(k, vocab), vocab)
    keep = rank < k
    masked = tl.where(keep, v, float("-inf"))
    e = tl.exp(masked - tl.max(masked, axis=0))
    probs = e / tl.sum(e, axis=0)
    mass_before = tl.cumsum(probs, axis=0) - probs
    keep = keep & (mass_before < tl.where(p >= 1.0, float("inf"), p))  # p >= 1: off
    keep = keep & (probs >= min_p * tl.max(probs, axis=0))
    return tl.where(keep, probs, 0.0), index
