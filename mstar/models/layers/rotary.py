"""Rotary position embedding: the cos/sin tables of a model, and per step a
`Rotary` (tables + positions [T]) that the attention context applies to q and
k, fused with its KV write.

cos/sin tables for every position up to `max_positions` are computed once, in
float32, at construction; a step only indexes them. The rotation follows the
Hugging Face "rotate_half" layout (the two halves of the head dim pair up), so
checkpoints load without permuting q/k weights. Calling the module applies it
directly: q [T, Hq, D], k [T, Hkv, D] and positions [T] in, rotated q, k out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar.errors import ConfigError
from mstar.kernels.rope_kv import apply_rope
from mstar.types import Rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the inverse frequencies are stretched for long context.

    `rope_type` "default" leaves them alone; "linear" divides all by `factor`;
    "llama3" divides the low frequencies by `factor` and blends the band
    between `low_freq_factor` and `high_freq_factor` wavelengths.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, max_position_embeddings: int) -> RopeScaling:
        """Read a config's `rope_scaling` (or transformers 5 `rope_parameters`) dict."""
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope type '{rope_type}' is not supported "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if rope_type == "default":
            return cls()
        if "factor" not in d:
            raise ConfigError(f"rope type '{rope_type}' needs a 'factor'")
        orig = d.get("original_max_position_embeddings") or max_position_embeddings
        return cls(
            rope_type=rope_type,
            factor=float(d["factor"]),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(orig),
        )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    assert old_len is not None
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are stretched by `factor`; short ones kept
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE at given positions; tables are buffers (not saved)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0,
                 scaling: RopeScaling | None = None, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ConfigError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inverse_frequencies(head_dim, theta, scaling or RopeScaling())
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)

    def at(self, positions: torch.Tensor) -> Rotary:
        """What the attention context applies for the tokens at `positions` [T]."""
        return Rotary(cos=self.cos, sin=self.sin, positions=positions)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, self.cos, self.sin, positions), apply_rope(k, self.cos, self.sin, positions)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"
