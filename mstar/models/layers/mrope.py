"""Interleaved multimodal rotary (Qwen3-Omni's M-RoPE): 3-axis positions
[3, T] (temporal, height, width) in, the cos and sin [T, head_dim] that the
"rotate half" layout applies to q and k out.

Each rotary frequency is driven by one axis. With `section` (t, h, w) pairs,
the first 3·h frequencies cycle T, H, W (frequency j takes H when j mod 3 is
1 and j < 3·h, W when j mod 3 is 2 and j < 3·w), and every other frequency
takes T; text, whose three axes are equal, rotates as with plain rotary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_axes(section: Sequence[int], size: int | None = None) -> torch.Tensor:
    """[size] int64 (default: sum(section)): the axis that drives each
    frequency. A section that does not sum to `size` is cut to it, or leaves
    the frequencies past it on T, as transformers reads one."""
    t, h, w = section
    j = torch.arange(t + h + w if size is None else size)
    axis = torch.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * h)] = 1
    axis[(j % 3 == 2) & (j < 3 * w)] = 2
    return axis


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                  axes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 2·len(inv_freq)] in float32 for positions [3, T];
    `axes`: `mrope_axes` of the section, on the positions' device (a model
    keeps it as a buffer: a step captured in a CUDA graph copies nothing from
    the host)."""
    if axes.numel() != inv_freq.numel():
        raise ValueError(f"mrope axes for {axes.numel()} frequencies do not cover {inv_freq.numel()}")
    angles = positions.float()[axes, :].T * inv_freq.float()  # [T, D/2]: frequency j by its axis's position
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()
