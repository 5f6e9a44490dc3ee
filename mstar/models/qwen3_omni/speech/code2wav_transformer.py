"""code2wav's pre-transformer: averaged code embeddings [B, T, H] in, the
same frames transformed [B, T, H] out. Layers are pre-norm attention (1-D
rotary, no q/k norm, causal within a sliding window of W frames) and a SwiGLU
MLP, each branch multiplied by a learned per-channel layer scale before the
residual add; a final RMSNorm.

A whole decode attends within the sequence. A step continues a row from its
last W - 1 frames of rotated keys and values per layer (`kv` [B, layers, 2,
W - 1, kv_heads, head_dim], oldest first) and its frame count: a window of W
frames reaches no further back, so the step is exact. Rotary angles use each
frame's index in the whole sequence, as a whole decode does; attention only
sees their differences, but equal angles round equally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.head_norm_rope import rope
from mstar.models.layers.linear import Linear
from mstar.models.layers.norm import RMSNorm
from mstar.models.qwen3_omni.config import Code2WavConfig

Device = torch.device | str | None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] by cos/sin [B, T, D], in float32 or finer."""
    b, t, heads, d = x.shape
    return rope(x.reshape(b * t, heads, d), cos.reshape(b * t, d), sin.reshape(b * t, d)).view(b, t, heads, d)


def window_mask(frames: torch.Tensor, held: int, new: int, window: int) -> torch.Tensor:
    """[B, new, held + new] bool: which of [held past frames, new frames]
    each new frame attends to, for rows whose new frames start at `frames`
    [B] (past frames before the sequence's start are not there)."""
    j = torch.arange(held + new, device=frames.device)
    i = torch.arange(new, device=frames.device)
    back = i[:, None] + held - j[None, :]          # how many frames before the query the key is
    band = (back >= 0) & (back < window)
    there = frames[:, None] - held + j[None, :] >= 0
    return band[None] & there[:, None, :]


class Code2WavAttention(nn.Module):
    def __init__(self, cfg: Code2WavConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, **kw)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, **kw)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, **kw)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] after `past_k`/`past_v` [B, P, kv_heads, D] (rotated);
        the output and [past, new] keys and values."""
        b, t, _ = x.shape
        q = _rotate(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), cos, sin)
        keys = torch.cat([past_k, k], dim=1)
        values = torch.cat([past_v, self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=self.head_dim ** -0.5, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), keys, values


class Code2WavLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Code2WavAttention(cfg, **kw)
        self.attn_scale = nn.Parameter(torch.empty(cfg.hidden_size, **kw), requires_grad=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.mlp_scale = nn.Parameter(torch.empty(cfg.hidden_size, **kw), requires_grad=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, keys, values = self.self_attn(self.input_layernorm(h), cos, sin, past_k, past_v, mask)
        h = h + self.attn_scale * a
        x = self.post_attention_layernorm(h)
        h = h + self.mlp_scale * self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return h, keys, values


class Code2WavTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(Code2WavLayer(cfg, **kw) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.kv_shape = (cfg.num_hidden_layers, 2, self.window - 1, cfg.num_key_value_heads, head_dim)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 angles whatever the module was cast to, as transformers computes them
        angles = positions.float()[..., None] * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A whole sequence, x [B, T, H] from its first frame."""
        b, t, _ = x.shape
        start = torch.zeros(b, dtype=torch.long, device=x.device)
        none = x.new_zeros(b, 0, *self.kv_shape[3:])
        cos, sin = self._cos_sin(torch.arange(t, device=x.device).expand(b, t))
        mask = window_mask(start, 0, t, self.window)
        for layer in self.layers:
            x, _, _ = layer(x, cos, sin, none, none, mask)
        return self.norm(x)

    def step(self, x: torch.Tensor, kv: torch.Tensor, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, k, H], the rows' next frames, which start at `frames` [B];
        the output and the rows' next `kv`."""
        k = x.shape[1]
        held = self.window - 1
        cos, sin = self._cos_sin(frames[:, None] + torch.arange(k, device=x.device))
        mask = window_mask(frames, held, k, self.window)
        out = []
        for i, layer in enumerate(self.layers):
            x, keys, values = layer(x, cos, sin, kv[:, i, 0], kv[:, i, 1], mask)
            out.append(torch.stack([keys[:, keys.shape[1] - held:], values[:, values.shape[1] - held:]], dim=1))
        return self.norm(x), torch.stack(out, dim=1)
