"""The Qwen3-Omni code predictor: the talker's last hidden state [B, H] and
the embedding of a frame's first code [B, H] in, the frame's other codes
[B, G - 1] out, drawn one by one, with their embeddings [B, G - 1, H],
which the talker's next step sums.

A dense Qwen3 decoder (q/k-normed grouped attention, SwiGLU) with a plain
one-axis rotary. Its cache lives for one frame: the two input rows sit at
positions 0 and 1 and predict code 1; code j (j >= 1), embedded by its own
table, sits at position j + 1 and predicts code j + 1 with head j. Every
row of a batch is at the same step, so the cache is one dense tensor per
layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar.kernels.qkv_store import KVDest
from mstar.models.layers.linear import Linear
from mstar.models.layers.mlp import SwiGLU
from mstar.models.layers.norm import RMSNorm
from mstar.models.layers.rotary import RotaryEmbedding
from mstar.models.qwen3_omni.config import CodePredictorConfig, MoeDecoderConfig
from mstar.models.qwen3_omni.thinker import ThinkerLayer

Device = torch.device | str | None
Draw = Callable[[torch.Tensor, int], torch.Tensor]  # (logits [B, V], j) -> code j + 1 [B] int64


class FrameCache:
    """The attention of B rows over a dense cache that starts empty: every
    call brings the same number n of new tokens per row, packed row after
    row ([B * n, heads, D]); they attend causally to the row's earlier ones.
    A layer's keys and values go into a buffer of the frame's `capacity`
    tokens, written where they land: a frame is fifteen short passes, and
    concatenating the cache at each would copy it all fifteen times."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.filled: dict[int, int] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        b = self.rows
        start = self._reserve(layer, q.shape[0], k.shape[1], k.shape[2], k.dtype, k.device)
        total = self.filled[layer]
        self.k[layer][:, start:total].copy_(k.reshape(b, -1, *k.shape[1:]))
        self.v[layer][:, start:total].copy_(v.reshape(b, -1, *v.shape[1:]))
        return self.attend(layer, q, scale)

    def kv_dest(self, layer: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> KVDest:
        """Where the step's `tokens` new keys and values go (`AttentionContext.kv_dest`)."""
        start = self._reserve(layer, tokens, kv_heads, head_dim, dtype, device)
        k, v = (c[layer].view(-1, kv_heads, head_dim) for c in (self.k, self.v))
        return KVDest(k, v, new=tokens // self.rows, start=start, capacity=self.capacity)

    def _reserve(self, layer: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> int:
        """Room for `tokens` more keys and values (the rows' next tokens, packed
        row after row) in layer `layer`'s buffers; where they start."""
        if tokens % self.rows:
            raise ValueError(f"{tokens} new tokens do not split over the frame's {self.rows} rows")
        if layer not in self.k:
            self.k[layer] = torch.empty(self.rows, self.capacity, kv_heads, head_dim, dtype=dtype, device=device)
            self.v[layer] = torch.empty_like(self.k[layer])
            self.filled[layer] = 0
        start, n = self.filled[layer], tokens // self.rows
        if start + n > self.capacity:
            raise ValueError(f"a frame's cache holds {self.capacity} tokens; {start + n} were written")
        self.filled[layer] = start + n
        return start

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The step's queries [B * n, heads, D] over their rows' keys so far
        (the step's own written already)."""
        b = self.rows
        q = q.reshape(b, -1, *q.shape[1:])  # [B, n, heads, D]
        total, n = self.filled[layer], q.shape[1]
        keys, values = (c[layer][:, :total].transpose(1, 2) for c in (self.k, self.v))  # [B, kv heads, t, D]
        # a frame's steps bring its first tokens (causal among themselves) or one token (sees every key):
        # no mask to build, and grouped heads read their KV head in place
        mask = None
        if 1 < n < total:
            mask = (torch.arange(total, device=q.device)[None, :]
                    <= (total - n + torch.arange(n, device=q.device))[:, None])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             is_causal=mask is None and n > 1, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, *q.shape[2:])


class CodePredictorLayer(ThinkerLayer):
    """The thinker's layer with a dense SwiGLU feed-forward."""

    def feed_forward(self, cfg: MoeDecoderConfig | CodePredictorConfig, kw: dict) -> nn.Module:
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, **kw)


class CodePredictor(nn.Module):
    """`complete` fills in a frame; `codec_embedding[g - 1]` and
    `lm_head[g - 1]` are code g's table and head (g = 1 .. G - 1)."""

    def __init__(self, cfg: CodePredictorConfig, *, device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.cfg = cfg
        groups = cfg.num_code_groups - 1
        self.layers = nn.ModuleList(CodePredictorLayer(cfg, i, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
                                             for _ in range(groups))
        self.lm_head = nn.ModuleList(Linear(cfg.hidden_size, cfg.vocab_size, **kw) for _ in range(groups))
        # positions never pass G: the frame's two input rows, then one a code
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.num_code_groups, cfg.rope_theta, device=device)

    def _last(self, x: torch.Tensor, start: int, cache: FrameCache) -> torch.Tensor:
        """x [B, n, H] at positions start .. start + n - 1 -> each row's last
        token, normed [B, H]."""
        b, n, _ = x.shape
        if n == 1:  # every row at one position: the table's row for all of them, a view
            cos, sin = (t[start:start + 1].expand(b, -1) for t in (self.rotary.cos, self.rotary.sin))
        else:
            positions = torch.arange(start, start + n, device=x.device).repeat(b)
            cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        h, residual = x.reshape(b * n, -1), None
        for layer in self.layers:
            h, residual = layer(h, cos, sin, cache, residual)
        if residual is None:
            return self.norm(h.view(b, n, -1)[:, -1])
        return self.norm(h.view(b, n, -1)[:, -1], residual.view(b, n, -1)[:, -1])[0]

    def complete(self, last: torch.Tensor, first: torch.Tensor, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        """`last` [B, H]: the talker's normed hidden state that sampled the
        frame's first code; `first` [B, H]: that code's talker embedding.
        Returns the codes 1 .. G - 1 [B, G - 1] int64 (code j + 1 is
        `draw(logits, j)`) and their embeddings [B, G - 1, H]."""
        # the frame's tokens: its two input rows, then one a code but the last (only embedded)
        cache = FrameCache(last.shape[0], max(2, self.cfg.num_code_groups))
        h = self._last(torch.stack([last, first], dim=1), 0, cache)
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for j, (table, head) in enumerate(zip(self.codec_embedding, self.lm_head)):
            codes.append(draw(head(h), j))
            embeds.append(table(codes[-1]))
            if j + 2 < self.cfg.num_code_groups:  # the last code is only embedded, never read back
                h = self._last(embeds[-1][:, None], j + 2, cache)
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1)
