"""The Qwen3-Omni thinker's text decoder over a `TokenBatch`: token ids and
3-axis positions in, with the encoders' rows spliced in at their placeholder
tokens (`embeds["audio"]`, `embeds["image"]`) and an image's deepstack
features (`embeds["deepstack"]`, [tokens, levels, H]) added to the residual
stream after the first decoder layers; logits of each row's last token out,
with the hidden states the talker reads (the embeddings after the splice and
the output of layer `accept_hidden_layer`).

A layer is pre-norm attention (q and k each RMS-normed per head before the
interleaved M-RoPE, grouped KV heads) then a sparse MoE feed-forward. The
rotation happens here, so the attention context only stores and attends.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels.head_norm_rope import head_norm_rope
from mstar.kernels.qkv_store import qkv_norm_rope_store
from mstar.models.layers.linear import Linear
from mstar.models.layers.moe import SparseMoe
from mstar.models.layers.mrope import mrope_axes, mrope_cos_sin
from mstar.models.layers.norm import RMSNorm
from mstar.models.layers.splice import spliced
from mstar.models.qwen3_omni.config import CodePredictorConfig, MoeDecoderConfig
from mstar.types import AttentionContext, TokenBatch

Device = torch.device | str | None


class ThinkerAttention(nn.Module):
    """Also the talker's and the code predictor's attention: the same maths
    at their own sizes."""

    def __init__(self, cfg: MoeDecoderConfig | CodePredictorConfig, layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.layer, self.heads, self.kv_heads, self.head_dim = (layer, cfg.num_attention_heads,
                                                                cfg.num_key_value_heads, cfg.head_dim)
        # q, k and v in one projection (the loader fills its three row blocks): one GEMM launch, not three
        self.qkv = Linear(cfg.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, **kw)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, **kw)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        kv_dest = getattr(attn, "kv_dest", None)
        # a context that says where k and v go: norms, rotary and the store in one pass (one eps for both norms)
        if kv_dest is not None and self.q_norm.eps == self.k_norm.eps:
            dest = kv_dest(self.layer, t, self.kv_heads, self.head_dim, qkv.dtype, qkv.device)
            q = qkv_norm_rope_store(qkv, self.heads, self.kv_heads, self.q_norm.weight, self.k_norm.weight, cos,
                                    sin, self.q_norm.eps, dest)
            return self.o_proj(attn.attend(self.layer, q, self.head_dim ** -0.5).reshape(t, -1))
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = head_norm_rope(q.view(t, self.heads, self.head_dim), self.q_norm.weight, cos, sin, self.q_norm.eps)
        k = head_norm_rope(k.view(t, self.kv_heads, self.head_dim), self.k_norm.weight, cos, sin, self.k_norm.eps)
        v = v.view(t, self.kv_heads, self.head_dim)
        out = attn.forward(self.layer, q, k, v, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(t, -1))


class ThinkerLayer(nn.Module):
    """Also the talker's layer (its config adds the shared expert), and the
    code predictor's with a dense feed-forward (`feed_forward`)."""

    def __init__(self, cfg: MoeDecoderConfig | CodePredictorConfig, layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = ThinkerAttention(cfg, layer, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = self.feed_forward(cfg, kw)

    def feed_forward(self, cfg: MoeDecoderConfig | CodePredictorConfig, kw: dict) -> nn.Module:
        assert isinstance(cfg, MoeDecoderConfig)
        return SparseMoe(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, cfg.shared_expert_intermediate_size, **kw)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream as (h, residual), its value h + residual (residual None:
        h alone): each norm forms the sum in its own pass, rounded as the
        unfused add rounds it. Returns the layer's output the same way."""
        x, residual = self.input_layernorm.stream(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, attn), residual)
        return self.mlp(x), residual


class ThinkerDecoder(nn.Module):
    """`prefill` and `decode` of a batch of rows; `accept_layer`: the layer
    whose output the talker reads (its `hidden` output)."""

    def __init__(self, cfg: MoeDecoderConfig, accept_layer: int, *, device: Device = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.cfg, self.accept_layer = cfg, accept_layer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(ThinkerLayer(cfg, i, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, **kw)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("mrope_axes", mrope_axes(cfg.mrope_section).to(device), persistent=False)

    def forward(self, batch: TokenBatch) -> dict[str, torch.Tensor]:
        """Every token's embedding and `accept_layer` output ("embeds",
        "hidden", [T, H]) and the logits of each row's last token."""
        embeds = spliced(self.embed_tokens(batch.input_ids), batch.embeds, ("audio", "image"))
        deep, deep_index = batch.embeds.get("deepstack", (None, None))
        positions = batch.positions if batch.positions.dim() == 2 else batch.positions.expand(3, -1)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_axes)
        h, residual, hidden = embeds, None, embeds
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, cos, sin, batch.attn, residual)
            stacked = deep is not None and i < deep.shape[1]
            if i + 1 == self.accept_layer or stacked:
                h, residual = h + residual, None
            if i + 1 == self.accept_layer:  # the talker reads a layer's output before its deepstack add
                hidden = h
            if stacked:
                h = h.index_add(0, deep_index, deep[:, i].to(h.dtype))
        rows = batch.logits_index
        last = self.norm(h[rows]) if residual is None else self.norm(h[rows], residual[rows])[0]
        return {"logits": self.lm_head(last), "embeds": embeds, "hidden": hidden}

    prefill = forward
    decode = forward
