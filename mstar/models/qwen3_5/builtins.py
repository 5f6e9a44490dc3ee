"""Qwen3.5 shapes served by name, without a folder, as config.json dicts:
`qwen3.5-tiny` (toy size, random weights, runs on the CPU, the byte
tokenizer's vocabulary), `qwen3.5-vl-tiny` (the same decoder with a toy
vision tower, three more ids for the image tokens), `qwen3.5-35b-a3b` (the
published MoE checkpoint's decoder, below) and `qwen3.5-9b`, the
published 9B checkpoint's shape (served with `--load-format dummy`): its
decoder is what transformers' `Qwen3_5TextConfig` defaults to, its tower
what `Qwen3_5VisionConfig` defaults to but for the output width, which is
the decoder's (the default 3584 could not feed a 4096-wide decoder; 4096 is
also what copies of the published config.json give), and its image ids are
`Qwen3_5Config`'s defaults.

A builtin with a tower renders chats with `BUILTIN_CHAT_TEMPLATE`: the byte
tokenizer's Llama-3 layout, with each image part where its message has it.
"""

from __future__ import annotations

from typing import Any

from mstar.models.qwen3_5.image_prompt import PLACEHOLDER
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

# the image tokens follow the byte tokenizer's ids (it encodes none of them: the prompt places them as ids)
_VL_TINY_IDS = {"vision_start_token_id": BYTE_TOKENIZER_VOCAB_SIZE,
                "vision_end_token_id": BYTE_TOKENIZER_VOCAB_SIZE + 1, "image_token_id": BYTE_TOKENIZER_VOCAB_SIZE + 2}
QWEN35_VL_TINY: dict[str, Any] = {
    "model_type": "qwen3_5", "tie_word_embeddings": True, **_VL_TINY_IDS,
    "text_config": {**QWEN35_TINY, "model_type": "qwen3_5_text", "vocab_size": BYTE_TOKENIZER_VOCAB_SIZE + 3},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                      "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                      "num_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
                      "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}},
}

QWEN35_9B: dict[str, Any] = {
    "model_type": "qwen3_5", "tie_word_embeddings": False,
    "image_token_id": 248056, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]},
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                      "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096,
                      "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
                      "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}},
}

# transformers' `Qwen3_5MoeTextConfig` defaults, which are the published 35B-A3B's decoder (40 layers of 2048, 256
# experts of 512 with 8 routed and a shared one); the rope and context as the 9B's; the tower the 9B's, whose output
# feeds this decoder's width
QWEN35_35B_A3B: dict[str, Any] = {
    "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "image_token_id": 248056, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
        "rope_parameters": QWEN35_9B["text_config"]["rope_parameters"],
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
    },
    "vision_config": {**QWEN35_9B["vision_config"], "out_hidden_size": 2048},
}

# builtin names and their config.json dicts
BY_NAME: dict[str, dict[str, Any]] = {"qwen3.5-tiny": QWEN35_TINY, "qwen3.5-vl-tiny": QWEN35_VL_TINY,
                                      "qwen3.5-9b": QWEN35_9B, "qwen3.5-35b-a3b": QWEN35_35B_A3B}

BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + PLACEHOLDER + "' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
