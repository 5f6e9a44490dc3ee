"""Qwen3.5 shapes served by name, without a folder, as config.json dicts:
`qwen3.5-tiny` (toy size, random weights, runs on the CPU, the byte
tokenizer's vocabulary) and `qwen3.5-9b`, the dense shape transformers'
`Qwen3_5TextConfig` defaults to (served with `--load-format dummy`)."""

from __future__ import annotations

from typing import Any

from mstar.models.tokenizer import BYTE_TOKENIZER_EOS, BYTE_TOKENIZER_VOCAB_SIZE

QWEN35_TINY: dict[str, Any] = {
    "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": BYTE_TOKENIZER_VOCAB_SIZE,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1]},
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "eos_token_id": list(BYTE_TOKENIZER_EOS),
}

QWEN35_9B: dict[str, Any] = {
    "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]},
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
}
