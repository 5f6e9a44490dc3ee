"""One draw per row in one program: a row's logits [B, V] (any float
dtype), temperature, top-k, top-p, min-p, seed and draw counter in, its
token ([B] int64) out. What the sampler does after penalties and bans:
temperature 0 takes the argmax; otherwise the logits are scaled by the
temperature, filtered (`race.py`: top-k, top-p, min-p) or not, and the
token whose probability over its Exp(1) noise (`noise.py`, drawn at the
row's counter + `offset`) is largest wins.

The torch form is about ten launches a draw (a float copy, the greedy
argmax, the scaling, the noise, the race, the selects), and a talker frame
draws sixteen times, one after another; here a draw is one launch, for
vocabularies up to `MAX_VOCAB` (a row in registers). Wider vocabularies (a
language model's) take `wide_draw.py` from `WIDE_MIN_ROWS` rows: the
filters' cuts found by value over blocks of the row, no sort.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mstar.kernels.backend import block_size, jit, num_warps, tl, use_triton
from mstar.kernels.sampling.head_race import HEAD_MIN_VOCAB, filtered_race_head
from mstar.kernels.sampling.noise import _INV_2_24, _MUL_A, _MUL_B, _ROW_SALT, _exp_noise, _row_key, exponential_noise
from mstar.kernels.sampling.race import MAX_VOCAB, _sorted_weights, filtered_race_reference
from mstar.kernels.sampling.wide_draw import draw_tokens_wide

# Rows from which a wide vocabulary's draw takes `wide_draw` on CUDA. The
# sampler launches it eagerly, about seventy launches, so below this the torch
# form's sort (fewer launches) is as fast on an H200 (`scripts/bench_sampler.py`:
# 1.7 ms each at 64 rows, the sort 3.7 ms against 2.3 at 128, 8.9 against 2.5 at 400).
WIDE_MIN_ROWS = 64


def draw_tokens(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, seeds: Tensor,
                counters: Tensor, offset: int = 0, filtered: bool = True, *, top_k_active: bool = True,
                top_p_active: bool = True, first: int = 0) -> Tensor:
    """`filtered`: whether any row filters (top-k, top-p or min-p); when
    none does the race runs over the whole softmax, as the sampler's plain
    path does. `top_k_active` / `top_p_active`: whether any row may cut by
    top-k / top-p (False lets a wide vocabulary's draw skip that search).
    `first`: the vocabulary index of the logits' column 0, where they are a
    window of it: each column draws its id's noise, so a window draws what
    the whole vocabulary would with every id outside it at -inf. The tokens
    returned are columns (add `first` for ids)."""
    if use_triton(logits):
        if logits.shape[-1] <= MAX_VOCAB:
            return draw_tokens_triton(logits, temperature, top_k, top_p, min_p, seeds, counters, offset, filtered,
                                      first)
        if logits.shape[0] >= WIDE_MIN_ROWS:
            return draw_tokens_wide(logits, temperature, top_k, top_p, min_p, seeds, counters, offset, filtered,
                                    top_k_active=top_k_active, top_p_active=top_p_active, first=first)
    return draw_tokens_reference(logits, temperature, top_k, top_p, min_p, seeds, counters, offset, filtered, first)


def compile_wide_draw(logits: Tensor, first: int = 0) -> None:
    """Compiles the wide draw's kernels for logits like `logits` [B, V] (a
    decode graph's output buffer, or the window of it the sampler draws from,
    at vocabulary index `first`), and for float32 logits (what a repetition
    penalty or a ban leaves), under every flag the sampler passes, by drawing
    from WIDE_MIN_ROWS of its rows; nothing where `draw_tokens`
    would not take the wide draw. Triton compiles a kernel on its first
    launch, seconds for the dozen here, which the first step of
    WIDE_MIN_ROWS rows would otherwise wait."""
    rows, vocab = logits.shape
    if not use_triton(logits) or vocab <= MAX_VOCAB or rows < WIDE_MIN_ROWS:
        return
    rows = WIDE_MIN_ROWS
    dev = logits.device
    f32 = torch.float32
    params = (torch.ones(rows, dtype=f32, device=dev), torch.full((rows,), 5, dtype=torch.int64, device=dev),
              torch.full((rows,), 0.9, dtype=f32, device=dev), torch.zeros(rows, dtype=f32, device=dev),
              torch.arange(rows, device=dev), torch.zeros(rows, dtype=torch.int64, device=dev))
    flags = ((False, False, False), (True, True, True), (True, False, True), (True, True, False), (True, False, False))
    for x in {logits.dtype: logits[:rows], torch.float32: logits[:rows].float()}.values():
        for filtered, top_k_active, top_p_active in flags:
            draw_tokens_wide(x, *params, 0, filtered, top_k_active=top_k_active, top_p_active=top_p_active,
                             first=first)


def draw_tokens_reference(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                          seeds: Tensor, counters: Tensor, offset: int = 0, filtered: bool = True,
                          first: int = 0) -> Tensor:
    logits = logits.float()
    is_greedy = temperature <= 0
    # the CPU skips the argmax where no row is greedy (elsewhere a CUDA graph may capture this: no branch)
    if logits.device.type == "cpu" and not bool(is_greedy.any()):
        greedy = torch.zeros(logits.shape[0], dtype=torch.long)
    else:
        greedy = torch.argmax(logits, dim=-1)
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature)[:, None]
    counters = counters + offset if offset else counters
    if filtered and logits.device.type == "cpu" and logits.shape[-1] >= HEAD_MIN_VOCAB:
        # the same tokens as the race below, sorting only each row's head
        drawn = filtered_race_head(scaled, top_k, top_p, min_p, seeds, counters, first, active=~is_greedy)
    else:
        noise = exponential_noise(seeds, counters, logits.shape[-1], first)
        drawn = (filtered_race_reference(scaled, top_k, top_p, min_p, noise) if filtered
                 else torch.argmax(torch.softmax(scaled, dim=-1) / noise, dim=-1))
    return torch.where(is_greedy, greedy, drawn)


def draw_tokens_triton(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                       seeds: Tensor, counters: Tensor, offset: int = 0, filtered: bool = True,
                       first: int = 0) -> Tensor:
    rows, vocab = logits.shape
    params = (temperature, top_k, top_p, min_p, seeds, counters)
    if vocab > MAX_VOCAB or any(p.shape != (rows,) for p in params):
        raise ValueError(f"logits {tuple(logits.shape)} with per-row parameters of {rows} rows, at most "
                         f"{MAX_VOCAB} columns")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        block = block_size(vocab)
        _draw_kernel[(rows,)](logits, logits.stride(0), temperature.float().contiguous(),
                              top_k.to(torch.int64).contiguous(), top_p.float().contiguous(),
                              min_p.float().contiguous(), seeds.to(torch.int64).contiguous(),
                              counters.to(torch.int64).contiguous(), out, vocab, offset, first, _MUL_A, _MUL_B,
                              _ROW_SALT, _INV_2_24, FILTER=filtered, BLOCK=block, num_warps=num_warps(block))
    return out


@jit(per_row=("temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr", "counters_ptr"),
     any_value=("offset", "first"))
def _draw_kernel(logits_ptr, stride, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, counters_ptr, out_ptr,
                 vocab, offset, first, mul_a, mul_b, salt, inv_2_24, FILTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rank = tl.arange(0, BLOCK)
    valid = rank < vocab
    x = tl.load(logits_ptr + row * stride + rank, mask=valid, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    greedy = tl.argmax(x, axis=0)
    scaled = tl.math.div_rn(x, tl.where(t <= 0.0, 1.0, t))   # rounded as torch's division: the same order
    key = _row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row) + offset, mul_a, mul_b, salt)
    if FILTER:
        weights, index = _sorted_weights(scaled, tl.load(top_k_ptr + row), tl.load(top_p_ptr + row),
                                         tl.load(min_p_ptr + row), vocab, BLOCK)
        noise = _exp_noise(key, index + first, mul_a, mul_b, inv_2_24)
        winner = tl.argmax(weights / noise, axis=0)
        drawn = tl.sum(tl.where(rank == winner, index, 0), axis=0)
    else:
        e = tl.exp(scaled - tl.max(scaled, axis=0))
        probs = e / tl.sum(e, axis=0)
        drawn = tl.argmax(probs / _exp_noise(key, rank + first, mul_a, mul_b, inv_2_24), axis=0)
    tl.store(out_ptr + row, tl.where(t <= 0.0, greedy, drawn).to(tl.int64))
