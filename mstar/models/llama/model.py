"""LlamaDecoder, the `llm` component: a packed `TokenBatch` of new tokens in,
logits [B, vocab] (in the weights' dtype) for one chosen token per row out.

Prefill and decode are the same computation over packed rows; only the number
of tokens per row differs. Attention goes through `batch.attn`, which owns the
paged KV cache and applies the rotary embedding (fused with its KV write), so
this module never sees pages, requests or devices.

Layers pass the residual stream beside the hidden states, (h, residual): each
norm adds the previous block's output into the stream and normalises it in
one fused pass.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, VocabHead, qkv_linear, token_embedding
from mstar.models.layers.norm_linear import norm_project
from mstar.models.llama.config import LlamaConfig
from mstar.types import AttentionContext, Rotary, TokenBatch

Device = torch.device | str | None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = qkv_linear(cfg.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                                   cfg.attention_bias, device=device, dtype=dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, cfg.attention_bias,
                             device=device, dtype=dtype)

    def forward(self, qkv: torch.Tensor, rotary: Rotary, attn: AttentionContext) -> torch.Tensor:
        """The block after its input projection, which the layer runs with its
        norm (`norm_project`): qkv [T, (Hq + 2 Hkv) D] in, [T, hidden] out."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer, q, k, v, self.scale, rotary=rotary)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, layer, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, device=device, dtype=dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) in, (this layer's MLP output, the stream before it) out;
        the stream after the layer is their sum, which the next norm forms.
        The first layer gets residual None: its input is the stream itself.
        Each norm runs with the projection after it (`norm_project`)."""
        qkv, residual = norm_project(self.input_layernorm, self.self_attn.qkv_proj, h, residual)
        h = self.self_attn(qkv, rotary, attn)
        act, residual = norm_project(self.post_attention_layernorm, self.mlp.gate_up, h, residual, silu=True)
        return self.mlp.down(act), residual


class LlamaDecoder(nn.Module):
    """The Llama decoder stack with its LM head.

    Parameters are allocated uninitialised on `device` in `dtype`; the loader
    fills them. `tie_word_embeddings` makes `lm_head` share the embedding.
    `max_positions` sizes the rotary tables (the served context length).
    """

    def __init__(self, cfg: LlamaConfig, *, max_positions: int | None = None, tie_word_embeddings: bool | None = None,
                 device: Device = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        head = VocabHead(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)
        self.embed_tokens = token_embedding(head, self.tie_word_embeddings, device=device, dtype=dtype)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i, device=device, dtype=dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = head   # registered last, as the checkpoint orders it
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, device=device)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def vocab_window(self) -> tuple[int, int] | None:
        """The ids whose logits the head computes, if not all (`VocabHead.restrict`)."""
        return self.lm_head.window

    @torch.no_grad()
    def forward(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        h = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        rotary = self.rotary.at(batch.positions)
        for layer in self.layers:  # at least one: the config refuses zero layers
            h, residual = layer(h, residual, rotary, batch.attn)
        # the last add, norm and head only on the rows whose logits are
        # wanted: the head is the largest matmul of a decode step
        rows = batch.logits_index
        h, _ = self.norm(h[rows], residual[rows])
        # in the weights' dtype: the sampler reads any float dtype, and a float32 copy of B x V logits would be a
        # pass over memory a step (0.2 ms at 400 rows of a 157k vocabulary on an H200)
        return {"logits": self.lm_head(h)}

    def prefill(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Rows of prompt tokens (any number per row, cached context or not)."""
        return self.forward(batch)

    def decode(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Rows of one new token each; the same computation as `prefill`."""
        return self.forward(batch)
