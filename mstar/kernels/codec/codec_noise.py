"""SNAC's seeded noise: each row's seed, a noise block and a column range
in, standard normals [B, length] out, a pure function of (seed, block,
column): the counter-based draws of `models/snac/noise.py`'s `SeededNoise`.

The torch form hashes int64 tensors holding 32-bit values, splitting every
multiply into 16-bit halves so no product overflows and the bits are the same
on every backend: about twenty-five launches a block, each a few microseconds
of a CUDA graph's replay whatever its size. The kernel is one launch, the
same hash in uint32 arithmetic (a product wraps mod 2**32, the bits the
halves give), then Box-Muller in float32.
"""

from __future__ import annotations

import math

import torch

from mstar.kernels.backend import jit, tl, use_triton

MASK32 = 0xFFFF_FFFF
GOLDEN = 0x9E37_79B9   # odd constants of murmur3 / the golden ratio: spread nearby inputs apart
MIX1 = 0x85EB_CA6B
MIX2 = 0xC2B2_AE35
TWO_PI = 2.0 * math.pi
BLOCK = 1024


def seeded_normal(seeds: torch.Tensor, block: int, length: int, start: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normals [B, length] in `dtype` for columns start, start + 1,
    ...: a pure function of each row's seed, `block` and the column."""
    if use_triton(seeds):
        return seeded_normal_triton(seeds, block, length, start, dtype)
    return seeded_normal_reference(seeds, block, length, start).to(dtype)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): products stay below 2**49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijection of 32-bit values with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 13)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def seeded_normal_reference(seeds: torch.Tensor, block: int, length: int, start: int = 0) -> torch.Tensor:
    """Standard normals [B, length] (float32) for columns start, start + 1,
    ...: a pure function of each row's seed, `block` and the column."""
    seeds = seeds.to(torch.int64)
    # fold both halves of the 64-bit seed, then the block, into one 32-bit key per row
    key = _fmix32((seeds & MASK32) ^ _fmix32((seeds >> 32) & MASK32))
    key = _fmix32(key ^ _mul32(torch.full_like(key, block + 1), GOLDEN)).unsqueeze(1)   # [B, 1]
    # two 32-bit words per sample (radius and angle of Box-Muller), counters 2t and 2t + 1
    counter = torch.arange(2 * start, 2 * (start + length), device=seeds.device, dtype=torch.int64).unsqueeze(0)
    bits = _fmix32(_fmix32(counter ^ key) ^ _mul32(key, GOLDEN))
    # 24 bits per uniform: float32 holds them exactly; +0.5 keeps u1 off zero (log(0))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    u1, u2 = uniform.view(-1, length, 2).unbind(-1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(TWO_PI * u2)


def seeded_normal_triton(seeds: torch.Tensor, block: int, length: int, start: int = 0,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(seeds.shape[0], length, dtype=dtype, device=seeds.device)
    if out.numel():
        grid = (seeds.shape[0], (length + BLOCK - 1) // BLOCK)
        _normal_kernel[grid](seeds.to(torch.int64).contiguous(), out, block + 1, length, start, GOLDEN, MIX1, MIX2,
                             TWO_PI, BLOCK=BLOCK, num_warps=4)
    return out


@jit
def _fmix(x, mix1, mix2):
    """murmur3's finaliser on uint32 (products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * mix1
    x = x ^ (x >> 13)
    x = x * mix2
    return x ^ (x >> 16)


@jit(any_value=("block", "start"))
def _normal_kernel(seeds_ptr, out_ptr, block, length, start, golden, mix1, mix2, two_pi, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m1 = tl.full((), mix1, tl.uint32)
    m2 = tl.full((), mix2, tl.uint32)
    gold = tl.full((), golden, tl.uint32)
    seed = tl.load(seeds_ptr + row)
    low = (seed & 0xFFFFFFFF).to(tl.uint32)
    high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _fmix(low ^ _fmix(high, m1, m2), m1, m2)
    key = _fmix(key ^ (tl.full((), block, tl.uint32) * gold), m1, m2)
    salt = key * gold
    counter = (2 * (start + cols)).to(tl.uint32)
    r_bits = _fmix(_fmix(counter ^ key, m1, m2) ^ salt, m1, m2)
    a_bits = _fmix(_fmix((counter + 1) ^ key, m1, m2) ^ salt, m1, m2)
    inv = 1.0 / 16777216.0
    u1 = ((r_bits >> 8).to(tl.float32) + 0.5) * inv
    u2 = ((a_bits >> 8).to(tl.float32) + 0.5) * inv
    z = tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(two_pi * u2)
    tl.store(out_ptr + row * length + cols, z.to(out_ptr.dtype.element_ty), mask=cols < length)
