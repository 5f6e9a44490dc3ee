"""Where the decoder's noise comes from: a batch shape in, one standard
normal draw [B, 1, T] per noise block out (shared by all channels of a row).

SNAC's decoder multiplies a fresh standard normal draw into each upsampling
block; the noise is part of the model's output, so it is kept. Two sources:

- `TorchNoise(generator)`: `torch.randn((B, 1, T))` from a torch generator
  (the global one by default), one call per block in block order, in the
  activations' dtype and device: exactly the package's draws. After
  `torch.manual_seed(s)`, a decode equals `snac.SNAC.decode` with the same
  weights and seed. A batch draws one [B, 1, T] tensor per block, so a row's
  noise depends on the batch it rides in: deterministic for a given batch,
  not per row.
- `SeededNoise(seeds)`: counter-based noise, a pure function of (the row's
  seed, the block, the sample index), hashed and turned into normals with
  Box-Muller. A row's output is then the same alone or in any batch, on any
  device, and a CUDA graph can replay it with the seeds in a static buffer
  (no generator state to capture). This is the serving choice: a request's
  audio does not depend on its neighbours.

The hash works on int64 tensors holding 32-bit values and splits every
32-bit multiply into 16-bit halves, so no product overflows int64 and the
bits are the same on every backend.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

MASK32 = 0xFFFF_FFFF
GOLDEN = 0x9E37_79B9   # odd constants of murmur3 / the golden ratio: spread nearby inputs apart
MIX1 = 0x85EB_CA6B
MIX2 = 0xC2B2_AE35
TWO_PI = 2.0 * math.pi


class NoiseSource(Protocol):
    def draw(self, block: int, batch: int, length: int, device: torch.device, dtype: torch.dtype,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Standard normal noise [batch, 1, length] for noise block `block`;
        with `cols` (start, stop), only those columns of it."""
        ...


class TorchNoise:
    """torch.randn from `generator` (None: the global generator of the device)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def draw(self, block: int, batch: int, length: int, device: torch.device, dtype: torch.dtype,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        # the whole draw either way: the generator's stream is the package's only with it
        noise = torch.randn((batch, 1, length), generator=self.generator, device=device, dtype=dtype)
        return noise if cols is None else noise[..., cols[0]:cols[1]]


class SeededNoise:
    """Per-row noise from `seeds` [B] (int64, any values): row b's draw in
    block k at sample t depends on (seeds[b], k, t) only."""

    def __init__(self, seeds: torch.Tensor) -> None:
        if seeds.dim() != 1 or seeds.dtype.is_floating_point or seeds.dtype == torch.bool:
            raise ValueError(f"seeds must be a 1-D integer tensor [B], got {seeds.dtype} {tuple(seeds.shape)}")
        self.seeds = seeds

    def draw(self, block: int, batch: int, length: int, device: torch.device, dtype: torch.dtype,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        if self.seeds.shape[0] != batch:
            raise ValueError(f"{self.seeds.shape[0]} seeds for a batch of {batch} rows")
        start, stop = cols if cols is not None else (0, length)
        return seeded_normal(self.seeds.to(device), block, stop - start, start).to(dtype).unsqueeze(1)


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


def seeded_normal(seeds: torch.Tensor, block: int, length: int, start: int = 0) -> torch.Tensor:
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
