"""A tiny random Qwen3.5 text checkpoint (transformers' `Qwen3_5ForCausalLM`),
saved the Hugging Face way: gated delta-net layers and gated attention
layers, grouped value heads, a partial rotary; logits wide enough that
greedy choices are not near-ties, and norm weights and decays off their
initial values so a wrong offset or gate shows."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_qwen35(folder: Path, vocab: int = 384, layers: int = 4, interval: int = 2,
                     dtype: torch.dtype = torch.float32, experts: int = 0, head_dim: int = 32,
                     value_heads: int = 4) -> Path:
    """`layers` decoder layers, every `interval`-th one attention; with
    `experts`, the MoE decoder (`Qwen3_5MoeForCausalLM`, 2 experts a token
    and a shared expert); `head_dim` 64 or more for FlashInfer's kernels;
    `value_heads` of the delta nets (8 makes their merged input projection
    208 rows, a multiple of 16 that fp8 weights take)."""
    import transformers

    torch.manual_seed(0)
    moe = {"num_experts": experts, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48} if experts else {"intermediate_size": 128}
    config_class = transformers.Qwen3_5MoeTextConfig if experts else transformers.Qwen3_5TextConfig
    cfg = config_class(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, **moe,
        num_key_value_heads=2, head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=value_heads,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [head_dim // 16, head_dim // 32, head_dim // 32]},
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model_class = transformers.Qwen3_5MoeForCausalLM if experts else transformers.Qwen3_5ForCausalLM
    model = model_class(cfg).to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias") or name.endswith("mlp.gate.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen).to(p.dtype))
    model.save_pretrained(folder, safe_serialization=True)
    return folder
