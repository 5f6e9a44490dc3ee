"""Qwen3-Omni's prompt positions: the audio encoder's token count per clip,
and the thinker's 3-axis M-RoPE positions and rope delta for prompts of text,
audio and images, equal to transformers' `get_rope_index` on a tiny thinker
built offline; placeholder runs that do not match their clips or grids are
refused."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from mstar.errors import RequestError
from mstar.models.layers.mrope import mrope_axes, mrope_cos_sin
from mstar.models.qwen3_omni.positions import audio_tokens, mrope_positions
from test_qwen3_omni_config import tiny

AUDIO, AUDIO_START, AUDIO_END = 151675, 151669, 151670
IMAGE, VISION_START, VISION_END = 151655, 151652, 151653


@pytest.mark.parametrize("frames", [1, 2, 7, 99, 100, 101, 250, 1000, 3001])
def test_audio_tokens_match_transformers(frames: int) -> None:
    assert audio_tokens(frames) == int(hf._get_feat_extract_output_lengths(torch.tensor(frames)))


@pytest.fixture(scope="module")
def thinker() -> hf.Qwen3OmniMoeThinkerForConditionalGeneration:
    return hf.Qwen3OmniMoeThinkerForConditionalGeneration(tiny().thinker_config).eval()


def _prompt(parts: list) -> list[int]:
    ids: list[int] = []
    for part in parts:
        if part[0] == "audio":
            ids += [AUDIO_START, *[AUDIO] * audio_tokens(part[1]), AUDIO_END]
        elif part[0] == "image":
            t, h, w = part[1]
            ids += [VISION_START, *[IMAGE] * (t * h * w // 4), VISION_END]
        else:
            ids += part[1]
    return ids


CASES = {
    "text": [("text", [1, 2, 3, 4])],
    "audio": [("text", [5, 6]), ("audio", 250), ("text", [7])],
    "image": [("text", [5]), ("image", (1, 4, 6)), ("text", [8, 9])],
    "both": [("text", [5, 6]), ("image", (1, 4, 6)), ("audio", 130), ("text", [3]), ("image", (1, 8, 4)),
             ("audio", 1000), ("text", [7, 8])],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_and_delta_match_transformers(thinker, case: str) -> None:
    parts = CASES[case]
    ids = _prompt(parts)
    frames = [p[1] for p in parts if p[0] == "audio"]
    grids = [p[1] for p in parts if p[0] == "image"]
    positions, delta = mrope_positions(ids, audio_id=AUDIO, image_id=IMAGE, audio_frames=frames, image_grids=grids)
    want, want_delta = thinker.model.get_rope_index(
        torch.tensor([ids]), image_grid_thw=torch.tensor(grids) if grids else None,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        audio_seqlens=torch.tensor(frames) if frames else None)
    assert torch.equal(positions, want[:, 0].long()) and delta == int(want_delta)


@pytest.mark.parametrize("frames, grids, says", [
    ([100], [], "audio 0 makes 13 tokens"),
    ([], [], "more audio placeholders"),
    ([250, 250], [], "1 audio clips and 0 images have no placeholders"),
    ([250], [(1, 4, 4)], "0 audio clips and 1 images"),
])
def test_placeholder_runs_must_match_their_clips(frames: list[int], grids: list, says: str) -> None:
    ids = _prompt([("text", [1]), ("audio", 250), ("text", [2])])
    with pytest.raises(RequestError, match=says) as caught:
        mrope_positions(ids, audio_id=AUDIO, image_id=IMAGE, audio_frames=frames, image_grids=grids)
    assert caught.value.field == "input"


def test_interleaved_mrope_matches_transformers_rotary(thinker) -> None:
    """cos and sin of an audio + image prompt's positions, as the thinker's
    own rotary embedding gives them (section (4, 2, 2) of 8 frequencies)."""
    parts = CASES["both"]
    ids = _prompt(parts)
    positions, _ = mrope_positions(ids, audio_id=AUDIO, image_id=IMAGE,
                                   audio_frames=[p[1] for p in parts if p[0] == "audio"],
                                   image_grids=[p[1] for p in parts if p[0] == "image"])
    rotary = thinker.model.language_model.rotary_emb
    cos, sin = mrope_cos_sin(positions, rotary.inv_freq, mrope_axes(rotary.mrope_section))
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert not torch.equal(positions[0], positions[1])  # the image rows make the axes differ
    torch.testing.assert_close(cos, want_cos[0])
    torch.testing.assert_close(sin, want_sin[0])
