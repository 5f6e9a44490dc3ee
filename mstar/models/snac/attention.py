"""Windowed self-attention of the SNAC decoder's stem (configs with an
`attn_window_size`: 32 and 44 kHz; the 24 kHz codec has none).

Activations [B, C, T] in and out, T a multiple of the window: pre-LayerNorm,
heads of 64 channels attending only within non-overlapping windows of
`window` frames, rotary positions counted from each window's start, output
projection, plus the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Device = torch.device | str | None
HEAD_DIM = 64
ROPE_BASE = 10_000.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LocalAttention(nn.Module):
    def __init__(self, dim: int, window: int, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.window = window
        self.heads = dim // HEAD_DIM
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)
        # positions only run over one window: the tables are fixed at build time
        inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        angles = torch.outer(torch.arange(window, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)   # [window, HEAD_DIM]
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        if t % self.window:
            raise ValueError(f"local attention needs a length that is a multiple of its window "
                             f"{self.window}, got {t} frames")
        w = t // self.window
        h = self.norm(x.transpose(1, 2))
        # [B, T, 3C] -> three of [B, heads, windows, window, HEAD_DIM]
        q, k, v = (part.reshape(b, w, self.window, self.heads, HEAD_DIM).permute(0, 3, 1, 2, 4)
                   for part in self.qkv(h).chunk(3, dim=-1))
        cos, sin = self.cos.to(q.dtype), self.sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, t, c)
        return self.out(out).transpose(1, 2) + x
