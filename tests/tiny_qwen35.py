"""Tiny random Qwen3.5 checkpoints, saved the Hugging Face way: the text
decoder alone (transformers' `Qwen3_5ForCausalLM`), or the whole model with
its vision tower (`Qwen3_5ForConditionalGeneration`) and what its processor
reads: a byte-level tokenizer with Qwen's special tokens, a chat template
that places images as Qwen's does, and a preprocessor_config.json with a
small pixel budget. Gated delta-net layers and gated attention layers,
grouped value heads, a partial rotary; logits wide enough that greedy
choices are not near-ties, norm weights and decays off their initial values
so a wrong offset or gate shows, and a tower at a trained scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lively_weights import lively

# byte b is token b; these follow, in this order (the ids the config names)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")
VISION_START, VISION_END, IMAGE, VIDEO = 259, 260, 261, 262
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# 2 to 12 merged blocks of 32 x 32 pixels an image
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 2048, "longest_edge": 12288},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _text_config(vocab: int, layers: int, interval: int, experts: int, head_dim: int,
                 value_heads: int = 4) -> dict[str, Any]:
    moe = {"num_experts": experts, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48} if experts else {"intermediate_size": 128}
    return dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, **moe,
        num_key_value_heads=2, head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=value_heads,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [head_dim // 16, head_dim // 32, head_dim // 32]},
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _off_initial(model: torch.nn.Module) -> None:
    """Greedy choices far from ties, norms, decays and router off their initial values."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias") or name.endswith("mlp.gate.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen).to(p.dtype))


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
    config_class = transformers.Qwen3_5MoeTextConfig if experts else transformers.Qwen3_5TextConfig
    cfg = config_class(**_text_config(vocab, layers, interval, experts, head_dim, value_heads))
    model_class = transformers.Qwen3_5MoeForCausalLM if experts else transformers.Qwen3_5ForCausalLM
    model = model_class(cfg).to(dtype)
    _off_initial(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_qwen35_vl(folder: Path, experts: int = 0, head_dim: int = 32) -> Path:
    """The whole model (`Qwen3_5ForConditionalGeneration`, or with `experts`
    the MoE one) in float32, with its tokenizer, chat template and
    preprocessor_config.json: a 2-block tower of 32 wide, 16-pixel patches,
    a 4 x 4 position table (stretched to each grid); `head_dim` of the
    decoder's attention (64 or more for FlashInfer's kernels)."""
    import transformers

    torch.manual_seed(0)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    config_class = transformers.Qwen3_5MoeConfig if experts else transformers.Qwen3_5Config
    cfg = config_class(text_config=_text_config(384, 4, 2, experts, head_dim), vision_config=vision,
                       image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                       vision_end_token_id=VISION_END)
    model_class = transformers.Qwen3_5MoeForConditionalGeneration if experts else \
        transformers.Qwen3_5ForConditionalGeneration
    model = model_class(cfg).eval()
    _off_initial(model)
    lively(model.model.visual, seed=2)
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder


def save_byte_tokenizer(folder: Path) -> None:
    """Byte b as token b, then `SPECIALS` (256 on), with `CHAT_TEMPLATE`: a
    folder's tokenizer files, for a model of at least 263 ids."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    from mstar.models.tokenizer import _byte_alphabet

    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())} | {s: 256 + i for i, s in enumerate(SPECIALS)}
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
