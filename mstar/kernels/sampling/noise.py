"""The sampler's randomness: (seed, draw counter, vocab index) in, 32
random bits or an Exp(1) draw out, as a pure function (murmur-style 32-bit
mixing), so a request draws the same whatever its batch, on any device.

The torch reference holds 32-bit values in int64 and masks after every
multiply: about 25 passes over a [B, V] int64 tensor per step, which at
batch 256 over a 157k vocabulary is gigabytes of memory traffic. The Triton
kernel computes the same bits in uint32 registers (a uint32 product wraps
mod 2**32, which is the masked int64 product) and writes only the float32
draws.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mstar.kernels.backend import jit, num_warps, tl, use_triton

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so
# int64 products never overflow (signed overflow is not portable across devices).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_ROW_SALT = 0x3C6EF372
_INV_2_24 = 1.0 / (1 << 24)
# float32's largest value below 1. The top 24-bit value plus the half step (2**24 - 0.5) rounds up to 2**24,
# so u would be 1.0 and the draw -log(1) = -0.0: a race's 0 / -0.0 is NaN, which argmax takes, so a masked
# or filtered-out token would win. Only that one value (a chance of 2**-24 a draw) is moved down.
_U_MAX = 1.0 - _INV_2_24


def mix32(x: Tensor) -> Tensor:
    """A bijective avalanche mix of 32-bit values held in int64 (values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: Tensor, counters: Tensor) -> Tensor:
    """One 32-bit key per row from its 64-bit seed and 64-bit draw counter."""
    # Masking after the shift also folds negative int64 seeds to their bit pattern.
    key = mix32((seeds & _M32) ^ _ROW_SALT)
    key = mix32(key ^ ((seeds >> 32) & _M32))
    key = mix32(key ^ (counters & _M32))
    return mix32(key ^ ((counters >> 32) & _M32))


def random_bits(seeds: Tensor, counters: Tensor, vocab_size: int, first: int = 0) -> Tensor:
    """[B, V] int64 of 32 random bits for each (row, vocab index), the
    indices from `first` (a window of the vocabulary draws the noise its ids
    would draw in the whole)."""
    at = torch.arange(first, first + vocab_size, device=seeds.device, dtype=torch.int64)
    return _mix_at(row_keys(seeds, counters), at)


def _mix_at(keys: Tensor, at: Tensor) -> Tensor:
    """32 random bits (int64) for row keys [B] at vocabulary indices `at`: [C] for every row, or [B, C]."""
    # Pre-mixing the index keeps neighbouring indices from sharing low-bit patterns.
    return mix32(keys[:, None] ^ mix32(at))


def exponential_noise(seeds: Tensor, counters: Tensor, vocab_size: int, first: int = 0) -> Tensor:
    """[B, V] float32 Exp(1) draws derived from `random_bits` (indices from `first`)."""
    if use_triton(seeds):
        return exponential_noise_triton(seeds, counters, vocab_size, first)
    return exponential_noise_reference(seeds, counters, vocab_size, first)


def exponential_noise_reference(seeds: Tensor, counters: Tensor, vocab_size: int, first: int = 0) -> Tensor:
    if seeds.device.type == "cpu":   # the same bits in uint32, which wraps as the masked int64 product does
        columns = np.arange(first, first + vocab_size, dtype=np.int64).astype(np.uint32)
        return _exp_of_bits(_cpu_bits(row_keys(seeds, counters), columns[None, :]))
    return _exp_of_bits(random_bits(seeds, counters, vocab_size, first) >> 8)


def _exp_of_bits(high: Tensor) -> Tensor:
    """Exp(1) draws from 24 random bits each (any integer dtype)."""
    # 24 bits fit a float32 mantissa exactly; the half-step keeps u above 0, the clamp below 1
    u = ((high.to(torch.float32) + 0.5) * _INV_2_24).clamp(max=_U_MAX)
    return -torch.log(u)


def _cpu_bits(keys: Tensor, columns: np.ndarray) -> Tensor:
    """`random_bits`' top 24 bits [B, C] for row keys [B] (int64) at vocabulary indices `columns` ([1, C] or
    [B, C], uint32), mixed in numpy's uint32 (a third of the int64 form's time on the CPU)."""
    mixed = _mix32_u32(keys.numpy().astype(np.uint32)[:, None] ^ _mix32_u32(columns))
    return torch.from_numpy((mixed >> np.uint32(8)).astype(np.int32))


def _mix32_u32(x: np.ndarray) -> np.ndarray:
    """`mix32` over uint32 arrays, where a product wraps mod 2**32 (a new array: `x` is left as it was)."""
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(_MUL_A)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_MUL_B)
    return x ^ (x >> np.uint32(16))


def exponential_noise_at(seeds: Tensor, counters: Tensor, columns: Tensor, first: int = 0) -> Tensor:
    """`exponential_noise_reference`'s draws [B, C] at vocabulary indices
    `first + columns` [B, C] only (the same bits: the same ops, elementwise)."""
    keys, at = row_keys(seeds, counters), columns.to(torch.int64) + first
    if seeds.device.type == "cpu":
        return _exp_of_bits(_cpu_bits(keys, at.numpy().astype(np.uint32)))
    return _exp_of_bits(_mix_at(keys, at) >> 8)


BLOCK = 1024


def exponential_noise_triton(seeds: Tensor, counters: Tensor, vocab_size: int, first: int = 0) -> Tensor:
    seeds, counters = seeds.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous()
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.numel():
        grid = (seeds.shape[0], (vocab_size + BLOCK - 1) // BLOCK)
        _noise_kernel[grid](seeds, counters, out, vocab_size, first, _MUL_A, _MUL_B, _ROW_SALT, _INV_2_24, BLOCK=BLOCK,
                            num_warps=num_warps(BLOCK))
    return out


@jit
def _mix32(x, mul_a, mul_b):
    x = x ^ (x >> 16)
    x = x * mul_a
    x = x ^ (x >> 15)
    x = x * mul_b
    return x ^ (x >> 16)


@jit
def _word(x, high: tl.constexpr):
    """One 32-bit half of an int64, as uint32 (the high half's bit pattern
    for negative values too)."""
    if high:
        x = x >> 32
    return (x & 0xFFFFFFFF).to(tl.uint32)


@jit
def _row_key(seed, counter, mul_a, mul_b, salt):
    """A row's 32-bit key (`row_keys`), mixed here rather than by ~30 launches of tiny torch ops per step."""
    a = tl.full((), mul_a, tl.uint32)
    b = tl.full((), mul_b, tl.uint32)
    key = _mix32(_word(seed, False) ^ tl.full((), salt, tl.uint32), a, b)
    key = _mix32(key ^ _word(seed, True), a, b)
    key = _mix32(key ^ _word(counter, False), a, b)
    return _mix32(key ^ _word(counter, True), a, b)


@jit
def _exp_noise(key, cols, mul_a, mul_b, inv_2_24):
    """The Exp(1) draws of a row with `key` at vocabulary indices `cols`."""
    a = tl.full((), mul_a, tl.uint32)
    b = tl.full((), mul_b, tl.uint32)
    idx = _mix32(cols.to(tl.uint32), a, b)
    bits = _mix32(key ^ idx, a, b)
    u = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * inv_2_24, 1.0 - inv_2_24)  # as the reference: below 1
    return -tl.log(u)


@jit(per_row=("seeds_ptr", "counters_ptr"), any_value=("first",))
def _noise_kernel(seeds_ptr, counters_ptr, out_ptr, vocab, first, mul_a, mul_b, salt, inv_2_24,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row), mul_a, mul_b, salt)
    tl.store(out_ptr + row * vocab + cols, _exp_noise(key, cols + first, mul_a, mul_b, inv_2_24),
             mask=cols < vocab)
