"""Qwen3-Omni's image input side against transformers: pictures into patches
equal to its image processor (loaded as a real preprocessor_config.json
configures it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from mstar.errors import RequestError
from mstar.models.qwen3_omni.encoders.image import image_patches

# The shape of the Qwen3-Omni checkpoints' preprocessor_config.json (its image part)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3OmniMoeProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
                "max_pixels": 12845056, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
FIELD = "messages[0].content[1].image_url"


def _picture(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _translucent(height: int, width: int, seed: int) -> Image.Image:
    alpha = np.random.default_rng(seed + 1).integers(0, 256, (height, width, 1), dtype=np.uint8)
    return Image.fromarray(np.concatenate([_picture(height, width, seed), alpha], axis=2))


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory):
    """transformers' image processor as it loads for a Qwen3-Omni folder, on
    the PIL backend (the one it picks without torchvision, as here)."""
    folder = tmp_path_factory.mktemp("omni-preprocessor")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    loaded = AutoImageProcessor.from_pretrained(folder, backend="pil")
    assert type(loaded).__name__ == "Qwen2VLImageProcessorPil"
    return loaded


@pytest.mark.parametrize("picture, min_pixels, max_pixels", [
    (_picture(37, 53, 0), 3136, 12845056),           # scaled up to the minimum
    (_translucent(301, 167, 1), 3136, 12845056),     # rounded to whole blocks; alpha over white
    (_picture(613, 419, 2), 3136, 64 * 32 * 32),     # scaled down to the maximum
], ids=["small", "translucent", "large"])
def test_patches_equal_transformers_image_processor(processor, picture, min_pixels: int, max_pixels: int) -> None:
    """Bit for bit: the same Pillow resize of the same 8-bit picture, then
    the same float operations in the same order."""
    want = processor(images=[picture], size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                     return_tensors="pt")
    got = image_patches(picture, min_pixels=min_pixels, max_pixels=max_pixels)
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    assert got.pixel_values.dtype == torch.float32 and torch.equal(got.pixel_values, want["pixel_values"])
    assert got.tokens == got.pixel_values.shape[0] // 4


def test_pictures_transformers_refuses_are_refused_naming_the_field(processor) -> None:
    narrow = _picture(1, 201, 3)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(images=[Image.fromarray(narrow)])
    with pytest.raises(RequestError, match="at most 200 times") as caught:
        image_patches(narrow, field=FIELD)
    assert caught.value.field == FIELD
    with pytest.raises(RequestError, match="0x4 pixels") as caught:
        image_patches(np.zeros((4, 0, 3), dtype=np.uint8), field=FIELD)
    assert caught.value.field == FIELD
    edge = _picture(1, 200, 4)  # the most elongated picture transformers takes
    assert image_patches(edge).grid_thw == tuple(processor(images=[Image.fromarray(edge)])["image_grid_thw"][0])
