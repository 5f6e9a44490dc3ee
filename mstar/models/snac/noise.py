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

The hash and its kernel are `kernels/codec/codec_noise.py`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mstar.kernels.codec.codec_noise import seeded_normal


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
        return seeded_normal(self.seeds.to(device), block, stop - start, start, dtype).unsqueeze(1)


__all__ = ["NoiseSource", "SeededNoise", "TorchNoise", "seeded_normal"]
