"""Token sampling for the rows of one step: logits [B, V] in, token ids [B]
out, and for the rows that asked, the tokens' log probabilities.

Every operation is vectorised over rows; no Python loop runs per row in the
hot path. Randomness is a pure function of (seed, counter, vocab index), so a
request draws the same tokens whichever rows share its batch, in whatever
order, and the noise bits are the same on CPU and CUDA.

Penalties come first: the repetition penalty over the ids a row has seen
(prompt and output), then the presence and frequency penalties over the
counts of the ids it generated (`outputs` [B, V]), as vLLM orders them.

Logprobs are of the model's raw distribution, log_softmax of the logits before
the penalties, temperature and filters (vLLM's default): what a row
reports does not depend on how it samples. They come packed, one float64 row
per step row, so that one copy per step brings them to the host: for a step
whose largest count is K, [logprob, top K logprobs, top K ids]; a row asking
for k < K uses the first k, a row that did not ask is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
from torch import Tensor

from mstar.engine.movement.transfer import to_device
from mstar.kernels.sampling.draw import draw_tokens
from mstar.kernels.sampling.penalty import repetition_penalty
from mstar.types import SamplingParams

NOT_ASKED = -1  # a row's logprobs count when its request reports none


@dataclass
class SamplingTensors:
    """The sampling parameters of a step's rows, on the logits' device (but
    `logprobs`)."""

    temperature: Tensor          # [B] float32; 0 = greedy
    top_k: Tensor                # [B] int64; <= 0 = off
    top_p: Tensor                # [B] float32
    min_p: Tensor                # [B] float32
    repetition_penalty: Tensor   # [B] float32
    seeds: Tensor                # [B] int64
    counters: Tensor             # [B] int64: index of each row's draw
    logprobs: Tensor             # [B] int64 on the host: top logprobs each row reports, NOT_ASKED for none
    all_greedy: bool
    any_penalty: bool
    any_filter: bool             # any sampled row with top-k, top-p or min-p active
    any_logprobs: bool
    # per row on the host: sampled, penalised, filtered, cut by top-k, cut by top-p, penalising its outputs
    # (what the flags are made of), so that picking rows recomputes the flags without reading the device;
    # None: picked rows keep the flags (conservative)
    host_flags: Tensor | None = None
    any_top_k: bool = True       # any sampled row with top-k on: a wide vocabulary's draw searches for its cut
    any_top_p: bool = True       # any sampled row with top-p below 1: likewise
    presence_penalty: Tensor | None = None    # [B] float32 (None: 0 for every row)
    frequency_penalty: Tensor | None = None   # [B] float32 (None: 0 for every row)
    any_output_penalty: bool = False          # any row with a presence or frequency penalty: `outputs` counts

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
              device: torch.device | str) -> SamplingTensors:
        if not len(params) == len(seeds) == len(counters):
            raise ValueError("params, seeds and counters must have one entry per row")
        sampled = [p for p in params if p.temperature > 0]
        host_flags = torch.tensor([[p.temperature > 0, p.repetition_penalty != 1.0,
                                    p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0),
                                    p.temperature > 0 and p.top_k > 0, p.temperature > 0 and p.top_p < 1.0,
                                    p.penalises_outputs]
                                   for p in params], dtype=torch.bool).reshape(len(params), 6)
        # one copy to the device per dtype, not one per column: the columns are rows of two tensors
        floats = to_device(torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                                         [p.min_p for p in params], [p.repetition_penalty for p in params],
                                         [p.presence_penalty for p in params], [p.frequency_penalty for p in params]],
                                        dtype=torch.float32), device)
        ints = to_device(torch.tensor([[p.top_k for p in params], list(seeds), list(counters)], dtype=torch.int64),
                         device)
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            seeds=ints[1],
            counters=ints[2],
            # on the host: it only picks the rows whose logprobs are computed
            logprobs=torch.tensor([NOT_ASKED if p.logprobs is None else p.logprobs for p in params],
                                  dtype=torch.int64),
            all_greedy=not sampled,
            any_penalty=any(p.repetition_penalty != 1.0 for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
            any_logprobs=any(p.logprobs is not None for p in params),
            host_flags=host_flags,
            any_top_k=bool(host_flags[:, 3].any()),
            any_top_p=bool(host_flags[:, 4].any()),
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            any_output_penalty=bool(host_flags[:, 5].any()),
        )

    def rows(self, sl: slice) -> SamplingTensors:
        """Rows `sl` (the flags stay those of every row: conservative)."""
        return SamplingTensors(**{f.name: _sliced(getattr(self, f.name), sl) for f in fields(self)})

    def cat(self, other: SamplingTensors) -> SamplingTensors:
        """These rows, then `other`'s."""
        out = {}
        for f in fields(self):
            x, y = getattr(self, f.name), getattr(other, f.name)
            if f.name == "host_flags":
                out[f.name] = None if x is None or y is None else torch.cat([x, y])
            elif isinstance(x, Tensor) or isinstance(y, Tensor):
                out[f.name] = torch.cat([_or_zeros(x, self), _or_zeros(y, other)])
            else:
                out[f.name] = x and y if f.name == "all_greedy" else x or y
        return SamplingTensors(**out)

    def select(self, idx: Tensor, host_idx: Tensor) -> SamplingTensors:
        """Rows `idx` (on the device; `host_idx` the same on the host), their
        flags recomputed, so that a group left with greedy rows is fast again."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in out.items():
            if isinstance(value, Tensor):
                out[name] = value[host_idx if value.device.type == "cpu" else idx]
        # from the host's copy: reading the device here would wait for the steps in flight
        flags = out["host_flags"]
        if flags is not None:
            out["all_greedy"] = not bool(flags[:, 0].any())
            out["any_penalty"] = bool(flags[:, 1].any())
            out["any_filter"] = bool(flags[:, 2].any())
            out["any_top_k"] = bool(flags[:, 3].any())
            out["any_top_p"] = bool(flags[:, 4].any())
            out["any_output_penalty"] = bool(flags[:, 5].any())
        out["any_logprobs"] = bool((out["logprobs"] != NOT_ASKED).any())
        return SamplingTensors(**out)


def _sliced(value: object, sl: slice) -> object:
    return value[sl] if isinstance(value, Tensor) else value


def _or_zeros(x: Tensor | None, st: SamplingTensors) -> Tensor:
    """An optional per-row column of `st`, zeros for its rows where it has none."""
    return x if x is not None else torch.zeros_like(st.temperature)


def banned_mask(banned: Tensor, vocab: int) -> Tensor:
    """[B, V] bool: the ids of each row of `banned` [B, S] (-1: none; an id
    past the vocabulary, which no draw gives, bans nothing)."""
    # the pads and ids past the vocabulary land in a column cut off below
    index = torch.where((banned >= 0) & (banned < vocab), banned, vocab)
    mask = torch.zeros(banned.shape[0], vocab + 1, dtype=torch.bool, device=banned.device)
    return mask.scatter_(1, index, True)[:, :vocab]


def banned_table(rows: list[tuple[int, ...]], device: torch.device | str) -> Tensor | None:
    """Each row's banned ids as one [B, S] table (-1 pads) on `device`; None when no row bans any."""
    if not any(rows):
        return None
    table = torch.full((len(rows), max(len(r) for r in rows)), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            table[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return to_device(table, device)


def sample(logits: Tensor, st: SamplingTensors, seen: Tensor | None = None, banned: Tensor | None = None,
           offset: int = 0, window: tuple[int, int] | None = None, outputs: Tensor | None = None) -> Tensor:
    """Draw one token per row: [B, V] logits (any float dtype, read as they
    are; copied to float32 only where a penalty or a ban rewrites them) ->
    [B] int64. `banned` [B, S]: ids a row may not draw yet (-1 pads; a
    `min_tokens` not reached). `outputs` [B, V]: how many times each row
    generated each id, where a row penalises them (`any_output_penalty`).
    `offset`: draws at the rows' counters plus
    this (a mode's j-th draw). `window` (first, end): every id outside it
    has a -inf logit (a head that computes only those ids'), so only that
    slice is read. Each id draws its own noise there, so the draw is the
    whole row's, but that the wide draw's block sums (`wide_draw.py`) start
    elsewhere in the row and may round differently in the last bit.

    Greedy rows take the argmax of the (penalised) logits. Other rows draw by
    an exponential race (argmax of probs / Exp noise), equivalent to sampling
    from the filtered softmax at the row's temperature (`kernels/sampling/draw.py`).
    """
    if window is None:
        return _sample(logits, st, seen, banned, offset, 0, outputs)
    first, end = window
    if banned is not None:  # ids outside the window can not be drawn anyway
        banned = torch.where((banned >= first) & (banned < end), banned - first, -1)
    return _sample(logits[:, first:end], st, None if seen is None else seen[:, first:end], banned, offset,
                   first, None if outputs is None else outputs[:, first:end]) + first


def _sample(logits: Tensor, st: SamplingTensors, seen: Tensor | None, banned: Tensor | None, offset: int,
            first: int, outputs: Tensor | None = None) -> Tensor:
    if st.any_penalty:
        if seen is None:
            raise ValueError("a row has a repetition penalty but no `seen` mask was given")
        logits = repetition_penalty(logits, seen, st.repetition_penalty)   # float32
    elif banned is not None or st.any_output_penalty:
        logits = logits.float()
    if st.any_output_penalty:
        if outputs is None:
            raise ValueError("a row has a presence or frequency penalty but no `outputs` counts were given")
        logits = output_penalties(logits, outputs, st.presence_penalty, st.frequency_penalty)
    if banned is not None:
        logits = logits.masked_fill(banned_mask(banned, logits.shape[-1]), float("-inf"))
    if st.all_greedy:
        return torch.argmax(logits, dim=-1)   # a float copy would not move the argmax: the values are exact
    return draw_tokens(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.counters, offset,
                       st.any_filter, top_k_active=st.any_top_k, top_p_active=st.any_top_p, first=first)


def output_penalties(logits: Tensor, outputs: Tensor, presence: Tensor | None, frequency: Tensor | None) -> Tensor:
    """float32 `logits` less each row's presence penalty where it generated an
    id and its frequency penalty times how often (`outputs` [B, V] counts)."""
    counts = outputs.float()
    pres = presence[:, None] if presence is not None else 0.0
    freq = frequency[:, None] if frequency is not None else 0.0
    return logits - freq * counts - pres * (counts > 0).float()


def token_logprobs(logits: Tensor, tokens: Tensor, st: SamplingTensors) -> Tensor | None:
    """The packed logprobs [B, 1 + 2K] float64 of the sampled `tokens`, on the
    logits' device; None when no row asked. Only the rows that asked are
    computed. `logits`: the raw ones the step sampled from."""
    if not st.any_logprobs:
        return None
    asked = (st.logprobs != NOT_ASKED).nonzero().flatten()
    if not asked.numel():  # a window of a group whose other rows asked
        return None
    k = int(st.logprobs[asked].max())
    rows = to_device(asked, logits.device)
    logp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    parts = [logp.gather(1, tokens.index_select(0, rows).reshape(-1, 1))]
    if k:
        top = torch.topk(logp, k, dim=-1)  # sorted, most likely first
        parts += [top.values, top.indices]
    # float64 holds the ids exactly (vocabularies are far below 2**53)
    packed = torch.cat([p.to(torch.float64) for p in parts], dim=1)
    out = torch.full((logits.shape[0], packed.shape[1]), float("nan"), dtype=torch.float64, device=logits.device)
    return out.index_copy_(0, rows, packed)
