"""Qwen3-Omni's config: a folder that transformers' own config class wrote
(a tiny random shape, offline) reads into the numbers of every part, equal to
what transformers holds; a field transformers would default or invent is
refused when missing, naming its path, as are widths the parts cannot hand
each other."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import Qwen3OmniMoeConfig

from mstar.errors import ConfigError
from mstar.models.qwen3_omni.config import Qwen3OmniConfig

H, CODES, GROUPS = 64, 64, 4
ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
TEXT = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            rope_parameters=ROPE)


def tiny() -> Qwen3OmniMoeConfig:
    return Qwen3OmniMoeConfig(
        thinker_config=dict(
            vision_start_token_id=151652, audio_token_id=151675, audio_start_token_id=151669,
            position_id_per_seconds=13,
            text_config=dict(TEXT, vocab_size=152064),
            audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16, output_dim=H,
                              downsample_hidden_size=8),
            vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H,
                               deepstack_visual_indexes=[0, 1, 2])),
        talker_config=dict(
            text_config=dict(TEXT, vocab_size=1024 + CODES, shared_expert_intermediate_size=32),
            code_predictor_config=dict(hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, vocab_size=CODES, num_code_groups=GROUPS,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            num_code_groups=GROUPS, thinker_hidden_size=H, accept_hidden_layer=2, spatial_merge_size=2,
            codec_pad_id=CODES, codec_bos_id=CODES + 1, codec_eos_token_id=CODES + 2, codec_nothink_id=CODES + 3,
            codec_think_bos_id=CODES + 4, codec_think_eos_id=CODES + 5,
            speaker_id={"Chelsie": CODES + 10, "ethan": CODES + 11}),
        code2wav_config=dict(codebook_size=CODES, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, num_quantizers=GROUPS, decoder_dim=64,
                             sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("omni")
    tiny().save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text())


def test_a_folder_written_by_transformers_reads_as_transformers_holds_it(written: tuple[Path, dict]) -> None:
    folder, _ = written
    cfg, ref = Qwen3OmniConfig.from_folder(folder), Qwen3OmniMoeConfig.from_pretrained(folder)
    text = ref.thinker_config.text_config
    assert (cfg.thinker.hidden_size, cfg.thinker.num_hidden_layers, cfg.thinker.head_dim, cfg.thinker.vocab_size) == (
        text.hidden_size, text.num_hidden_layers, text.head_dim, text.vocab_size)
    assert (cfg.thinker.num_experts, cfg.thinker.num_experts_per_tok, cfg.thinker.moe_intermediate_size) == (4, 2, 32)
    assert cfg.thinker.mrope_section == (4, 2, 2) and cfg.thinker.rope_theta == 1e6 and cfg.thinker.norm_topk_prob
    assert cfg.thinker.shared_expert_intermediate_size == 0  # the thinker's MoE has none
    assert cfg.talker.decoder.shared_expert_intermediate_size == 32 and cfg.talker.decoder.vocab_size == 1024 + CODES
    assert cfg.audio.d_model == ref.thinker_config.audio_config.d_model and cfg.audio.output_dim == H
    assert cfg.audio.n_window == ref.thinker_config.audio_config.n_window
    assert cfg.vision.deepstack_visual_indexes == (0, 1, 2) and cfg.vision.patch_size == 16
    talker = ref.talker_config
    assert (cfg.talker.accept_hidden_layer, cfg.talker.num_code_groups, cfg.talker.codec_eos_id) == (
        talker.accept_hidden_layer, talker.num_code_groups, talker.codec_eos_token_id)
    assert cfg.talker.voices == {"chelsie": CODES + 10, "ethan": CODES + 11}  # names as a request spells them
    assert cfg.talker.projection_size == 128 and cfg.talker.code_predictor.vocab_size == CODES
    assert cfg.code2wav.sliding_window == 8 and cfg.code2wav.rope_theta == 1e4
    assert cfg.code2wav.samples_per_frame == 1920  # 8 * 5 * 4 * 3 * 2 * 2
    assert (cfg.ids.audio, cfg.ids.audio_start, cfg.ids.vision_start, cfg.ids.tts_pad, cfg.ids.assistant) == (
        151675, 151669, 151652, ref.tts_pad_token_id, ref.assistant_token_id)
    assert cfg.position_id_per_seconds == 13


def _without(data: dict, path: str) -> dict:
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    del node[last]
    return data


def _with(data: dict, path: str, value: Any) -> dict:
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[last] = value
    return data


@pytest.mark.parametrize("path", [
    "thinker_config.text_config.head_dim",          # transformers falls back to hidden / heads: 64, not 128
    "thinker_config.vision_start_token_id",         # transformers fails on an image prompt
    "talker_config.text_config.shared_expert_intermediate_size",
    "talker_config.speaker_id",
    "talker_config.accept_hidden_layer",
])
def test_a_field_transformers_would_default_or_miss_is_refused_by_name(written: tuple[Path, dict], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.") + " is missing"):
        Qwen3OmniConfig.from_dict(_without(written[1], path))


@pytest.mark.parametrize("path, value, says", [
    ("thinker_config.text_config.rope_parameters", {"rope_theta": 1e6, "mrope_section": [4, 2, 1]},
     "summing to head_dim / 2"),
    ("thinker_config.audio_config.output_dim", 32, "the thinker is 64 wide"),
    ("talker_config.accept_hidden_layer", 4, "outside 1..3"),
    ("code2wav_config.num_quantizers", 8, "differs from the talker's 4 code groups"),
    ("talker_config.code_predictor_config.num_code_groups", 3, "differs from the code predictor's 3"),
    ("talker_config.text_config.num_experts_per_tok", 9, "outside 1..4"),
    ("model_type", "llama", "not 'qwen3_omni_moe'"),
])
def test_parts_that_cannot_fit_together_are_refused(written: tuple[Path, dict], path: str, value: Any,
                                                    says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Qwen3OmniConfig.from_dict(_with(written[1], path, value))


def test_the_builtin_tiny_shape_reads_as_transformers_would_write_it(tmp_path: Path) -> None:
    """`qwen3-omni-tiny`'s dict gives the same numbers read directly as after
    transformers' config class took it in and wrote it out."""
    from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_TINY

    fields = {k: v for k, v in QWEN3_OMNI_TINY.items() if k != "model_type"}
    Qwen3OmniMoeConfig(**copy.deepcopy(fields)).save_pretrained(tmp_path)
    assert Qwen3OmniConfig.from_dict(QWEN3_OMNI_TINY) == Qwen3OmniConfig.from_folder(tmp_path)


def test_the_30b_shape_builds_the_thinker_transformers_builds(tmp_path: Path) -> None:
    """`qwen3-omni-30b-a3b` reads as transformers would write it, and mstar's
    thinker of that shape (on the meta device) has transformers' parameter
    shapes, tensor for tensor in count and size; served only with dummy
    weights, since it names no checkpoint."""
    import torch
    from transformers import Qwen3OmniMoeThinkerTextModel

    from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_30B_A3B
    from mstar.models.qwen3_omni.thinker import ThinkerDecoder
    from mstar.models.registry import load_model

    fields = {k: v for k, v in QWEN3_OMNI_30B_A3B.items() if k != "model_type"}
    Qwen3OmniMoeConfig(**copy.deepcopy(fields)).save_pretrained(tmp_path)
    ours = Qwen3OmniConfig.from_dict(QWEN3_OMNI_30B_A3B)
    assert ours == Qwen3OmniConfig.from_folder(tmp_path)
    hf_config = Qwen3OmniMoeConfig(**copy.deepcopy(fields)).thinker_config.text_config
    with torch.device("meta"):
        theirs = Qwen3OmniMoeThinkerTextModel(hf_config)
        mine = ThinkerDecoder(ours.thinker, ours.talker.accept_hidden_layer)
    lm_head = ours.thinker.vocab_size * ours.thinker.hidden_size
    assert sum(p.numel() for p in mine.parameters()) == sum(p.numel() for p in theirs.parameters()) + lm_head
    assert 30e9 < sum(p.numel() for p in mine.parameters()) < 32e9
    with pytest.raises(ConfigError, match="load-format dummy"):
        load_model("qwen3-omni-30b-a3b", load_format="auto")
