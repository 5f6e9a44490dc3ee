"""Qwen35Decoder, the `llm` component: a packed `TokenBatch` of new tokens
(and each row's state slot) in, logits [B, vocab] for one chosen token per
row out. Prefill and decode are one computation over packed rows; an image
prompt's prefill (`prefill_image`) also brings the vision tower's rows, which
take the place of its image placeholders' embeddings (`embeds["image"]`),
and 3-axis positions.

Layers are gated delta nets (`delta_net.py`: per-row recurrent state) or
gated attention over the paged KV cache: q and k RMS-normalised per head, a
rotary over the first `rotary_dim` dims of each head (multimodal positions
[3, T] interleaved, text's three axes equal; `kernels.head_norm_rope` fuses
the norm and the rotation), and the output scaled by
sigmoid of a gate the query projection also yields. The KV pages hold only
the attention layers, numbered in order (`Qwen35Config.attention_layers`).
The feed-forward is a SwiGLU, or in a MoE decoder a sparse MoE with a shared
expert behind a sigmoid gate (its routing weights renormalised).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.head_norm_rope import head_norm_rope
from mstar.models.layers import CenteredRMSNorm, Linear, SwiGLU, VocabHead, token_embedding
from mstar.models.layers.moe import SparseMoe
from mstar.models.layers.mrope import mrope_axes, mrope_cos_sin
from mstar.models.layers.splice import spliced
from mstar.models.qwen3_5.config import FULL, Qwen35Config
from mstar.models.qwen3_5.delta_net import GatedDeltaNet
from mstar.types import AttentionContext, TokenBatch

Device = torch.device | str | None


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen35Config, kv_layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        """`kv_layer`: this layer's index in the KV pages."""
        super().__init__()
        self.kv_layer = kv_layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # one projection for the query with its gate (per head: query, then gate), the key and the value
        self.qkv_rows = (2 * self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.qkv = Linear(cfg.hidden_size, sum(self.qkv_rows), cfg.attention_bias, device=device, dtype=dtype)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, cfg.attention_bias, device=device,
                             dtype=dtype)
        self.q_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv(x).split(self.qkv_rows, dim=-1)
        q, gate = qg.view(t, self.heads, 2 * d).split(d, dim=-1)
        # rounded as transformers rotates in bfloat16: its logits, not a more precise answer
        q = head_norm_rope(q, self.q_norm.weight, cos, sin, self.q_norm.eps, centered=True, rounded=True)
        k = head_norm_rope(k.view(t, self.kv_heads, d), self.k_norm.weight, cos, sin, self.k_norm.eps,
                           centered=True, rounded=True)
        out = attn.forward(self.kv_layer, q.contiguous(), k.contiguous(), v.reshape(t, self.kv_heads, d), self.scale)
        return self.o_proj((out.view(t, self.heads, d) * torch.sigmoid(gate)).view(t, self.heads * d))


class Qwen35Layer(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        if cfg.layer_types[layer] == FULL:
            self.self_attn = GatedAttention(cfg, cfg.attention_layers.index(layer), device=device, dtype=dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, cfg.delta_layers.index(layer), device=device, dtype=dtype)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = SparseMoe(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, True,
                             cfg.shared_expert_intermediate_size, device=device, dtype=dtype) if cfg.num_experts \
            else SwiGLU(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) in, (this layer's MLP output, the stream before it) out, as a Llama layer's."""
        h, residual = self.input_layernorm.stream(h, residual)
        if hasattr(self, "self_attn"):
            h = self.self_attn(h, cos, sin, batch.attn)
        else:
            assert batch.state is not None, "a delta-net layer needs the rows' state slots"
            h = self.linear_attn(h, batch.state, batch.query_start)
        h, residual = self.post_attention_layernorm.stream(h, residual)
        return self.mlp(h), residual


class Qwen35Decoder(nn.Module):
    """The hybrid decoder stack with its LM head; parameters uninitialised
    on `device` in `dtype` until the loader fills them."""

    def __init__(self, cfg: Qwen35Config, *, tie_word_embeddings: bool | None = None, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        head = VocabHead(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)
        self.embed_tokens = token_embedding(head, self.tie_word_embeddings, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Qwen35Layer(cfg, i, device=device, dtype=dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = head
        dim = cfg.rotary_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("rope_axes", mrope_axes(cfg.mrope_section, dim // 2).to(device), persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @torch.no_grad()
    def forward(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = spliced(self.embed_tokens(batch.input_ids), batch.embeds, ("image",))
        positions = batch.positions if batch.positions.dim() == 2 else batch.positions[None].expand(3, -1)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.rope_axes)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, batch)
        rows = batch.logits_index
        assert residual is not None
        h, _ = self.norm.stream(h[rows], residual[rows])
        return {"logits": self.lm_head(h)}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Rows of prompt tokens, each continuing from its slot's state and cached KV."""
        return self.forward(batch)

    def prefill_image(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Rows of prompt tokens with images: the tower's rows at the
        placeholders, positions [3, T] (a row's text after an image goes on
        from past the image's largest position)."""
        return self.forward(batch)

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Rows of one new token each; the same computation as `prefill`."""
        return self.forward(batch)
