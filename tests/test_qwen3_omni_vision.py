"""Qwen3-Omni's image input side against transformers: pictures into patches
equal to its image processor (loaded as a real preprocessor_config.json
configures it), the vision encoder's rows and deepstack features equal to
its `Qwen3OmniMoeVisionEncoder` for several images in one call, and a text +
image prompt whose thinker logits, fed mstar's rows and deepstack features
through `inputs_embeds`, equal the thinker fed the pixels. All float32 on
tiny random models saved to folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

from mstar.errors import ConfigError, RequestError
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.qwen3_omni.loader import load_vision
from mstar.models.qwen3_omni.positions import mrope_positions
from mstar.models.vision.config import VisionEncoderConfig
from mstar.models.vision.encoder import VisionEncoder
from mstar.models.vision.patches import ImagePatches, image_patches
from lively_weights import lively
from test_qwen3_omni_config import tiny

# The shape of the Qwen3-Omni checkpoints' preprocessor_config.json (its image part)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3OmniMoeProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
                "max_pixels": 12845056, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
FIELD = "messages[0].content[1].image_url"
VISION_END = 151653  # not in the config: transformers never reads it


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


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3OmniMoeForConditionalGeneration]:
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(tiny()).eval()
    with torch.no_grad():  # transformers leaves stacked experts uninitialised
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    lively(model.thinker.model.visual, seed=0)
    folder = tmp_path_factory.mktemp("omni-weights")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def odd_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[VisionEncoderConfig, Path,
                                                                   Qwen3OmniMoeVisionEncoder]:
    """A vision encoder of another shape: a 4x4 position table (stretched,
    not shrunk, to the grids below), 16-wide heads, and deepstack after
    layers 2 and 0 only, listed out of order."""
    torch.manual_seed(1)
    config = Qwen3OmniMoeVisionEncoderConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                                             out_hidden_size=24, num_position_embeddings=16,
                                             deepstack_visual_indexes=[2, 0])
    encoder = Qwen3OmniMoeVisionEncoder(config).eval()
    lively(encoder, seed=1)
    folder = tmp_path_factory.mktemp("omni-vision")
    save_file({f"thinker.visual.{k}": v.contiguous() for k, v in encoder.state_dict().items()},
              str(folder / "model.safetensors"))
    cfg = VisionEncoderConfig(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4,
                              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=24,
                              num_position_embeddings=16, deepstack_visual_indexes=(2, 0))
    return cfg, folder, encoder


def _ours(cfg: VisionEncoderConfig, folder: Path) -> VisionEncoder:
    encoder = VisionEncoder(cfg).eval()
    load_vision(encoder, folder)
    return encoder


def _images() -> list[ImagePatches]:
    return [image_patches(_picture(h, w, seed)) for seed, (h, w) in enumerate([(100, 150), (37, 53), (64, 200)])]


@pytest.fixture(scope="module")
def cases(saved, odd_encoder) -> dict[str, tuple[VisionEncoder, Qwen3OmniMoeVisionEncoder, torch.Tensor, torch.Tensor]]:
    """Per encoder shape: ours, transformers', and a batch of images of
    different sizes (pixels, grids)."""
    folder, model = saved
    images = _images()
    tiny_case = (_ours(Qwen3OmniConfig.from_folder(folder).vision, folder), model.thinker.model.visual,
                 torch.cat([i.pixel_values for i in images]), torch.tensor([i.grid_thw for i in images]))
    cfg, odd_folder, odd = odd_encoder
    grids = torch.tensor([[1, 6, 10], [2, 4, 6], [1, 2, 8]])  # the second has two frames, which do not attend across
    pixels = torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(2))
    return {"tiny": tiny_case, "odd": (_ours(cfg, odd_folder), odd, pixels, grids)}


@pytest.mark.parametrize("case", ["tiny", "odd"])
@torch.inference_mode()
def test_encoder_rows_and_deepstack_equal_transformers(cases, case: str) -> None:
    """Several images in one call. Tolerance: assert_close's float32
    defaults (atol 1e-5, rtol 1.3e-6) on outputs of size ~1, for the same
    maths summed in another order (a linear map for the Conv3d, one padded
    attention call for the per-frame ones); the gaps seen are ~1e-6."""
    ours, theirs, pixels, grids = cases[case]
    want = theirs(pixels, grid_thw=grids)
    got = ours(pixels, grids)
    tokens = int(grids.prod(1).sum()) // 4
    assert got.embeds.shape == (tokens, ours.cfg.out_hidden_size)
    assert got.deepstack.shape == (len(ours.cfg.deepstack_visual_indexes), tokens, ours.cfg.out_hidden_size)
    torch.testing.assert_close(got.embeds, want.pooler_output)
    torch.testing.assert_close(got.deepstack, torch.stack(list(want.deepstack_features)))


@pytest.mark.parametrize("case", ["tiny", "odd"])
@torch.inference_mode()
def test_a_batch_equals_each_image_alone(cases, case: str) -> None:
    """Padding a small frame to a large one's length, masked, changes
    nothing beyond float rounding (same tolerance)."""
    ours, _, pixels, grids = cases[case]
    batch = ours(pixels, grids)
    alone = [ours(p, g[None]) for p, g in zip(pixels.split(grids.prod(1).tolist()), grids)]
    torch.testing.assert_close(batch.embeds, torch.cat([a.embeds for a in alone]))
    torch.testing.assert_close(batch.deepstack, torch.cat([a.deepstack for a in alone], dim=1))


def test_a_checkpoint_without_a_vision_tensor_is_refused(saved, tmp_path: Path) -> None:
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["thinker.visual.merger_list.1.mlp.0.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): deepstack_mergers\.1\.fc1\.bias"):
        _ours(Qwen3OmniConfig.from_folder(folder).vision, tmp_path)


@torch.inference_mode()
def test_an_image_prompt_spliced_from_our_encoder_gives_transformers_logits(saved) -> None:
    """transformers' thinker fed the pixels, against the same thinker fed
    `inputs_embeds` with our rows at the image placeholders, our deepstack
    features added after its first layers at those positions, and positions
    from `mrope_positions`: every prefill logit within 1e-4 (three float32
    MoE layers at this size stay far inside it); without the deepstack
    features they differ far beyond it."""
    folder, model = saved
    cfg = Qwen3OmniConfig.from_folder(folder)
    images = _images()[:2]
    ids: list[int] = [cfg.ids.im_start, cfg.ids.user, 198]
    for text, image in zip(([100, 2001], [37, 4242, 9]), images):
        ids += [*text, cfg.ids.vision_start, *[cfg.ids.image] * image.tokens, VISION_END]
    ids += [77, cfg.ids.im_end, 198, cfg.ids.im_start, cfg.ids.assistant, 198]
    pixels, grids = torch.cat([i.pixel_values for i in images]), torch.tensor([i.grid_thw for i in images])
    input_ids = torch.tensor([ids])
    want = model.thinker(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                         image_grid_thw=grids).logits[0]

    vision = _ours(cfg.vision, folder)(pixels, grids)
    placeholders = input_ids[0] == cfg.ids.image
    embeds = model.thinker.get_input_embeddings()(input_ids)[0]
    embeds[placeholders] = vision.embeds
    positions, _ = mrope_positions(ids, audio_id=cfg.ids.audio, image_id=cfg.ids.image,
                                   image_grids=[i.grid_thw for i in images],
                                   spatial_merge=cfg.vision.spatial_merge_size,
                                   per_second=cfg.position_id_per_seconds)

    def logits(deepstack: list[torch.Tensor] | None) -> torch.Tensor:
        hidden = model.thinker.model.language_model(inputs_embeds=embeds[None], position_ids=positions[:, None],
                                                    visual_pos_masks=placeholders[None] if deepstack else None,
                                                    deepstack_visual_embeds=deepstack).last_hidden_state
        return model.thinker.lm_head(hidden)[0]

    got = logits(list(vision.deepstack))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (logits(None) - want).abs().max() > 1e-2


@pytest.mark.parametrize("field, value, says", [
    ("deepstack_visual_indexes", [0, 3], r"distinct layers in 0\.\.2"),   # transformers would skip layer 3 silently
    ("deepstack_visual_indexes", [1, 1], r"distinct layers in 0\.\.2"),
    ("num_position_embeddings", 50, "is not a square"),
    ("num_heads", 3, "divisible by 4"),
    ("hidden_act", "relu", "is not one of"),
])
def test_vision_configs_the_encoder_cannot_run_are_refused(saved, field: str, value, says: str) -> None:
    folder, _ = saved
    data = json.loads((folder / "config.json").read_text())
    assert Qwen3OmniConfig.from_dict(data).vision.rope_theta == 10000.0
    data["thinker_config"]["vision_config"][field] = value
    with pytest.raises(ConfigError, match=says):
        Qwen3OmniConfig.from_dict(data)
