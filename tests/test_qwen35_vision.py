"""Qwen3.5 with its vision tower on the CPU, against transformers'
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
with the same weights (a tiny random checkpoint saved by transformers with
its tokenizer, chat template and preprocessor settings), float32.

The prompt mstar makes of a chat with images equals what transformers'
processor makes of it (ids, patches, grids), its positions equal
`get_rope_index`'s, the tower's rows equal `get_image_features`; greedy
tokens equal `generate`'s for chats with one image, two images of
different sizes in one message, and text alone, run concurrently while text
prompts go in chunks and image prompts whole. Through HTTP, the official
`openai` client's chat with an `image_url` data URL against
`qwen3.5-vl-tiny` answers, and an image that does not decode is a 400."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from http_support import openai_client
from PIL import Image
from safetensors.torch import load_file, save_file
from tiny_qwen35 import IMAGE, save_tiny_qwen35, save_tiny_qwen35_vl

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.errors import ConfigError
from mstar.models.qwen3_5.loader import load_tower
from mstar.models.qwen3_5.model import Qwen35Model
from mstar.models.registry import load_model
from mstar.models.vision.encoder import VisionEncoder
from mstar.types import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402

NEW = 8


def _picture(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# grids (1, 4, 6), (1, 8, 4) and, scaled down to the budget, (1, 8, 4): 6, 8 and 8 tokens
SMALL, TALL, LARGE = _picture(50, 90, 0), _picture(120, 70, 1), _picture(300, 200, 2)


def _image(picture: np.ndarray) -> dict[str, Any]:
    return {"type": "image", "image": picture}


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [{"type": "text", "text": "what is here? "}, _image(SMALL)]}],
    [{"role": "user", "content": [_image(TALL), {"type": "text", "text": "and this one?"}]}],
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": [{"type": "text", "text": "compare "}, _image(SMALL),
                                  {"type": "text", "text": " with "}, _image(LARGE)]}],
    [{"role": "user", "content": "no picture here, only a question about the weather"}],
]


class _ImageProcessor(Qwen3VLProcessor):
    """transformers' processor for these checkpoints, without its video
    processor: that needs torchvision, which is not installed here."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        return None if argument_name == "video_processor" else super().check_argument_for_proper_class(
            argument_name, argument)


def _as_pil(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [{**p, "image": Image.fromarray(p["image"])} if p.get("type") == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages]


class Reference:
    """A saved checkpoint, transformers' model and processor of it, and its answers."""

    def __init__(self, folder: Path, experts: int, head_dim: int = 32) -> None:
        self.folder = save_tiny_qwen35_vl(folder, experts=experts, head_dim=head_dim)
        cls = transformers.Qwen3_5MoeForConditionalGeneration if experts else \
            transformers.Qwen3_5ForConditionalGeneration
        self.model = cls.from_pretrained(folder, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None   # as the engine's ignore_eos
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        images = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
        self.processor = _ImageProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None,
                                         chat_template=tokenizer.chat_template)

    def inputs(self, messages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.processor.apply_chat_template(_as_pil(messages), tokenize=True, return_dict=True,
                                                  add_generation_prompt=True, return_tensors="pt")

    @torch.no_grad()
    def answer(self, messages: list[dict[str, Any]]) -> list[int]:
        inputs = self.inputs(messages)
        out = self.model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("qwen35-vl"), experts=0)


async def _answers(engine: Engine, chats: list[list[dict[str, Any]]]) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

    async def one(i: int, messages: list[dict[str, Any]]) -> list[int]:
        request = GenerateRequest(f"r{i}", engine.model_name, {"messages": messages}, greedy)
        chunks = [c async for c in engine.submit(request)]
        assert chunks[-1].error is None, chunks[-1].error
        return [t for c in chunks for t in c.token_ids]
    return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(chats))))


def test_the_prompt_equals_the_processors_and_its_positions_get_rope_index(dense: Reference) -> None:
    """Ids (the template's placement, each `<|image_pad|>` expanded to its
    image's merged blocks), patches bit for bit, grids, then 3-axis
    positions and the rope delta equal to transformers'."""
    model = load_model(str(dense.folder))
    for messages in CHATS[:3]:
        want = dense.inputs(messages)
        request = GenerateRequest("p", model.name, {"messages": messages}, SamplingParams())
        assert model.walk_for(request) == "generate+image"
        got = model.prepare_inputs(request, SamplingParams()).values
        assert got["prompt_ids"].tolist() == want["input_ids"][0].tolist()
        assert torch.equal(got["image_pixels"], want["pixel_values"])
        assert torch.equal(got["image_grids"], want["image_grid_thw"])
        positions, delta = dense.model.model.get_rope_index(want["input_ids"], want["mm_token_type_ids"],
                                                            image_grid_thw=want["image_grid_thw"])
        assert torch.equal(got["positions"], positions[:, 0])
        assert int(got["positions"].max()) + 1 - got["prompt_ids"].numel() == int(delta) < 0
    grids = dense.inputs(CHATS[2])["image_grid_thw"].tolist()
    assert grids == [[1, 4, 6], [1, 8, 4]]


@torch.inference_mode()
def test_the_tower_equals_get_image_features(dense: Reference) -> None:
    """Three images of different sizes in one call. Tolerance: assert_close's
    float32 defaults, for the same maths summed in another order (a linear
    map for the Conv3d, one padded attention call for the per-image ones)."""
    model = load_model(str(dense.folder))
    tower = VisionEncoder(model.config.vision)
    load_tower(tower, dense.folder)
    patches = [model.patch_recipe.patches(p, "image") for p in (SMALL, TALL, LARGE)]
    pixels, grids = torch.cat([p.pixel_values for p in patches]), torch.tensor([p.grid_thw for p in patches])
    want = dense.model.model.get_image_features(pixels, grids).pooler_output
    got = tower(pixels, grids)
    assert got.deepstack.shape[0] == 0 and got.embeds.shape == (6 + 8 + 8, 64)
    torch.testing.assert_close(got.embeds, torch.cat(want))


async def test_greedy_tokens_equal_transformers(dense: Reference) -> None:
    """Four chats at once: an image each (of two sizes), two images in one
    message, text alone. A step takes at most 16 tokens: the text prompt
    runs in chunks, an image prompt whole (the runtime splits no step that
    brings embeddings); their decode steps run as one group."""
    want = [dense.answer(messages) for messages in CHATS]
    assert want[0] != want[1] != want[2]
    engine = Engine(EngineConfig(model=str(dense.folder), scheduler=SchedulerConfig(
        page_size=4, max_num_batched_tokens=16)))
    await engine.start()
    steps: list[tuple[str, int]] = []
    engine.add_report_hook(lambda r: steps.append((r.mode, r.rows)) if r.component == "llm" else None)
    try:
        assert await _answers(engine, CHATS) == want
        mixed = engine.workers[0].stats.mixed_rows
    finally:
        await engine.shutdown()
    assert mixed > 0   # text chunks rode in the image rows' decode steps, which go on past their rope delta
    modes = {mode for mode, _ in steps}
    assert {"prefill", "prefill_image", "decode"} <= modes
    assert max(rows for mode, rows in steps if mode == "decode") == len(CHATS)
    assert sum(rows for mode, rows in steps if mode == "prefill") > 1   # the text prompt's chunks
    assert sum(rows for mode, rows in steps if mode == "prefill_image") == 3   # each image prompt in one step


async def test_the_moe_model_matches_transformers(tmp_path: Path) -> None:
    """`qwen3_5_moe`: the same tower before the MoE decoder."""
    reference = Reference(tmp_path, experts=4)
    chats = [CHATS[2], CHATS[3]]
    want = [reference.answer(messages) for messages in chats]
    engine = Engine(EngineConfig(model=str(tmp_path), scheduler=SchedulerConfig(page_size=4)))
    await engine.start()
    try:
        assert await _answers(engine, chats) == want
    finally:
        await engine.shutdown()


def test_a_text_only_folder_has_no_tower_and_a_dummy_load_fills_it(dense: Reference, tmp_path: Path) -> None:
    text = load_model(str(save_tiny_qwen35(tmp_path / "text")))
    assert text.config.vision is None and set(text.components) == {"llm"} and text.input_modalities == ("text",)
    model = load_model(str(dense.folder))
    assert model.config.image_tokens.image == IMAGE and model.input_modalities == ("text", "image")
    dummy = Qwen35Model("dummy", str(dense.folder), "dummy")
    tower = dummy.build_component("vision", torch.device("cpu"), torch.float32).encoder
    saved = load_file(str(dense.folder / "model.safetensors"))["model.visual.pos_embed.weight"]
    assert tower.pos_embed.weight.isfinite().all() and not torch.equal(tower.pos_embed.weight, saved)


def test_a_checkpoint_without_a_tower_tensor_is_refused(dense: Reference, tmp_path: Path) -> None:
    tensors = load_file(str(dense.folder / "model.safetensors"))
    del tensors["model.visual.merger.linear_fc1.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(dense.folder))
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): merger\.fc1\.bias"):
        load_tower(VisionEncoder(model.config.vision), tmp_path)


def _png_url(height: int, width: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(_picture(height, width, 3)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_the_openai_client_chats_with_an_image_and_one_that_does_not_decode_is_a_400() -> None:
    """The picture is decoded, cut into patches and placed: the prompt is the
    text-only chat's plus its image's placeholders and their two bounds. A
    data URL whose bytes are no picture fails that request alone, naming
    its part."""
    import openai  # here, so the GPU tests can import this module's helpers on a machine without it

    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    question = {"type": "text", "text": "what is this?"}
    tokens = load_model("qwen3.5-vl-tiny").patch_recipe.patches(_picture(40, 60, 3), "image").tokens
    async with openai_client(EngineConfig(model="qwen3.5-vl-tiny", scheduler=SchedulerConfig(page_size=4))) as api:
        seen = await api.chat.completions.create(model="qwen3.5-vl-tiny", messages=[{"role": "user", "content": [
            question, {"type": "image_url", "image_url": {"url": _png_url(40, 60)}}]}], **greedy)
        alone = await api.chat.completions.create(model="qwen3.5-vl-tiny", messages=[{"role": "user", "content": [
            question]}], **greedy)
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(model="qwen3.5-vl-tiny", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAAA"}}]}], **greedy)
        after = await api.chat.completions.create(model="qwen3.5-vl-tiny", messages=[{"role": "user", "content": [
            question]}], **greedy)
    assert seen.choices[0].message.role == "assistant" and seen.usage.completion_tokens == 5
    assert seen.usage.prompt_tokens == alone.usage.prompt_tokens + tokens + 2
    assert caught.value.status_code == 400 and caught.value.body["param"] == "messages[0].content[0].image_url.url"
    assert after.choices[0].message.content == alone.choices[0].message.content


def test_the_9b_builtin_has_the_tower_transformers_builds_for_its_config() -> None:
    """Every tensor of transformers' `Qwen3_5VisionModel` for `qwen3.5-9b`'s
    vision config fills a parameter of ours of as many elements (built on
    the meta device: no weights)."""
    from mstar.models.qwen3_5.builtins import QWEN35_9B
    from mstar.models.vision.encoder import _vision_target

    model = load_model("qwen3.5-9b", load_format="dummy")
    assert model.config.vision is not None and model.config.image_tokens.image == 248056
    ours = dict(VisionEncoder(model.config.vision, device="meta").named_parameters())
    with torch.device("meta"):
        theirs = transformers.Qwen3_5VisionModel(transformers.Qwen3_5VisionConfig(**QWEN35_9B["vision_config"]))
    shapes = {_vision_target(name): p.numel() for name, p in theirs.named_parameters()}
    assert shapes == {name: p.numel() for name, p in ours.items()} and len(shapes) == 3 + 12 * 27 + 6


def test_the_35b_a3b_builtin_has_as_many_weights_as_transformers_builds_for_its_config() -> None:
    """The MoE shape, decoder (merged and stacked as ours are) and tower, counted on the meta device against
    transformers' `Qwen3_5MoeForConditionalGeneration` for the same config: 35.1B, the published size."""
    from mstar.models.qwen3_5.builtins import QWEN35_35B_A3B
    from mstar.models.qwen3_5.decoder import Qwen35Decoder

    model = load_model("qwen3.5-35b-a3b", load_format="dummy")
    assert model.config.vision is not None and model.config.num_experts == 256
    decoder = Qwen35Decoder(model.config, device=torch.device("meta"), dtype=torch.bfloat16)
    ours = {"decoder": sum(p.numel() for p in decoder.parameters()),
            "tower": sum(p.numel() for p in VisionEncoder(model.config.vision, device="meta").parameters())}
    with torch.device("meta"):
        reference = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**QWEN35_35B_A3B))
    theirs = {"decoder": 0, "tower": 0}
    for name, p in reference.named_parameters():
        theirs["tower" if ".visual." in name else "decoder"] += p.numel()
    assert ours == theirs and 35.0e9 < sum(ours.values()) < 35.2e9


def test_a_prompt_past_the_context_is_refused_before_its_images_are_cut(dense: Reference,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each picture's token count comes from its size: a chat whose images overrun the context is a 400
    (`context_length_exceeded`, naming `messages`) without a patch cut (under a real checkpoint's budget a
    4096-pixel square is ~400 MB of patches). The tiny checkpoint's budget makes a 64-pixel square 4 tokens
    and its context 2048: 400 of them overrun it."""
    from mstar.errors import RequestError
    from mstar.models.vision.preprocessor import PatchRecipe

    model = load_model(str(dense.folder))
    square = np.zeros((64, 64, 3), dtype=np.uint8)
    chat = [{"role": "user", "content": [*[_image(square)] * 400, {"type": "text", "text": "what are they?"}]}]
    request = GenerateRequest("big", model.name, {"messages": chat}, SamplingParams())

    def cut(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("patches were cut for a prompt past the context")
    monkeypatch.setattr(PatchRecipe, "patches", cut)
    with pytest.raises(RequestError) as refused:
        model.prepare_inputs(request, SamplingParams())
    assert refused.value.field == "messages" and refused.value.code == "context_length_exceeded"
    assert model.max_model_len == 2048 and model.patch_recipe.grid(square, "x") == (1, 4, 4)


def test_null_pixel_budget_keys_leave_size_to_set_it() -> None:
    """transformers reads a null `min_pixels` / `max_pixels` as absent: `size` then sets the budget."""
    from mstar.models.vision.preprocessor import PatchRecipe

    default = PatchRecipe(patch_size=16, temporal_patch_size=2, merge_size=2)
    recipe = PatchRecipe._from({"min_pixels": None, "max_pixels": None,
                                "size": {"shortest_edge": 1024, "longest_edge": 4096}}, default, "test")
    assert (recipe.min_pixels, recipe.max_pixels) == (1024, 4096)


def test_placeholder_tokens_typed_in_the_text_are_refused_naming_messages(dense: Reference) -> None:
    from mstar.errors import RequestError

    model = load_model(str(dense.folder))
    # one token of the placeholder, or the whole of it as the template writes an image
    for typed in ("look: <|image_pad|> here", "look: <|vision_start|><|image_pad|><|vision_end|> here"):
        chat = [{"role": "user", "content": [{"type": "text", "text": typed}, _image(SMALL)]}]
        with pytest.raises(RequestError, match="placeholder tokens") as refused:
            model.prepare_inputs(GenerateRequest("typed", model.name, {"messages": chat}, SamplingParams()),
                                 SamplingParams())
        assert refused.value.field == "messages"
