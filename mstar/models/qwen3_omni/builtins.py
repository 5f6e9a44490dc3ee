"""Qwen3-Omni shapes served by name, without a folder: `qwen3-omni-tiny`, a
config.json-style dict of every part at toy size (random weights, runs on
the CPU), with the real model's special token ids so prompts read as its do.
"""

from __future__ import annotations

from typing import Any

_ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
         "rope_parameters": _ROPE}
_CODES, _GROUPS = 64, 4

QWEN3_OMNI_TINY: dict[str, Any] = {
    "model_type": "qwen3_omni_moe",
    "im_start_token_id": 151644, "im_end_token_id": 151645, "system_token_id": 8948, "user_token_id": 872,
    "assistant_token_id": 77091, "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "thinker_config": {
        "audio_token_id": 151675, "audio_start_token_id": 151669, "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "position_id_per_seconds": 13,
        "text_config": {**_TEXT, "vocab_size": 152064},
        "audio_config": {"num_mel_bins": 128, "d_model": 16, "encoder_layers": 1, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 32, "n_window": 50, "n_window_infer": 800, "downsample_hidden_size": 8,
                         "output_dim": 64, "max_source_positions": 1500},
        "vision_config": {"depth": 3, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "patch_size": 16,
                          "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 64,
                          "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1, 2]},
    },
    "talker_config": {
        "text_config": {**_TEXT, "vocab_size": 1024 + _CODES, "shared_expert_intermediate_size": 32},
        "code_predictor_config": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                                  "vocab_size": _CODES, "num_code_groups": _GROUPS,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "num_code_groups": _GROUPS, "thinker_hidden_size": 64, "accept_hidden_layer": 2,
        "codec_pad_id": _CODES, "codec_bos_id": _CODES + 1, "codec_eos_token_id": _CODES + 2,
        "codec_nothink_id": _CODES + 3, "codec_think_bos_id": _CODES + 4, "codec_think_eos_id": _CODES + 5,
        "speaker_id": {"chelsie": _CODES + 10, "ethan": _CODES + 11, "aiden": _CODES + 12},
    },
    "code2wav_config": {"codebook_size": _CODES, "num_quantizers": _GROUPS, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                        "sliding_window": 8, "decoder_dim": 64, "upsample_rates": [8, 5, 4, 3],
                        "upsampling_ratios": [2, 2], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
}

# Qwen3-Omni-30B-A3B-Instruct's shape, as its config.json gives it (served with --load-format dummy)
_ROPE_30B = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20], "interleaved": True}
_CODEBOOK_30B = 2048
QWEN3_OMNI_30B_A3B: dict[str, Any] = {
    **{k: v for k, v in QWEN3_OMNI_TINY.items() if k.endswith("_token_id")},
    "model_type": "qwen3_omni_moe",
    "thinker_config": {
        **{k: v for k, v in QWEN3_OMNI_TINY["thinker_config"].items() if k.endswith("_token_id")},
        "position_id_per_seconds": 13,
        "text_config": {"hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
                        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "shared_expert_intermediate_size": 0, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 65536, "rope_parameters": _ROPE_30B},
        "audio_config": {"num_mel_bins": 128, "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                         "encoder_ffn_dim": 5120, "n_window": 50, "n_window_infer": 800, "downsample_hidden_size": 480,
                         "output_dim": 2048, "max_source_positions": 1500},
        "vision_config": {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
                          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
                          "out_hidden_size": 2048, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24]},
    },
    "talker_config": {
        "text_config": {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 3072,
                        "moe_intermediate_size": 384, "num_experts": 128, "num_experts_per_tok": 6,
                        "norm_topk_prob": True, "shared_expert_intermediate_size": 768, "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 65536, "rope_parameters": _ROPE_30B},
        "code_predictor_config": {"hidden_size": 1024, "num_hidden_layers": 5, "num_attention_heads": 16,
                                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                                  "vocab_size": _CODEBOOK_30B, "num_code_groups": 16, "rms_norm_eps": 1e-6,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "num_code_groups": 16, "thinker_hidden_size": 2048, "accept_hidden_layer": 24,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "spatial_merge_size": 2, "position_id_per_seconds": 13,
        **{k: v for k, v in QWEN3_OMNI_TINY["thinker_config"].items() if k.endswith("_token_id")},
    },
    "code2wav_config": {"codebook_size": _CODEBOOK_30B, "num_quantizers": 16, "hidden_size": 1024,
                        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
                        "intermediate_size": 3072, "sliding_window": 72, "decoder_dim": 1536,
                        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "rms_norm_eps": 1e-5,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
}
