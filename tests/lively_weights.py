"""Random weights at the scale of a trained vision encoder, for tests that
compare one against transformers': at transformers' small random init the
signal fades through the blocks and a wrong detail would hide in rounding."""

from __future__ import annotations

import torch


def lively(module: torch.nn.Module, seed: int) -> None:
    """Norms near 1, linear maps of unit gain, biases and the position table
    of order 0.1 and 1. At N(0, 0.08) throughout, the signal shrinks at every
    norm until attention is near uniform and the rotary, the merger's GELU,
    even swapped rows and columns change the output by less than the
    tolerance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif name.startswith("pos_embed"):
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)
