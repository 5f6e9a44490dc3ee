"""A Qwen3.5 chat prompt with images: chat `messages` whose content parts may
hold decoded pictures (`{"type": "image", "image": RGB uint8 [H, W, 3]}`, as
the HTTP layer hands them over) in; the prompt's token ids, each image's
patches, and the prompt's 3-axis M-RoPE positions out.

The checkpoint's chat template places the images: it is given each image
part as `{"type": "image"}` and writes `<|vision_start|><|image_pad|>
<|vision_end|>` for it, as Qwen's templates do. That becomes the config's
start id, one image id per merged 2x2 block of the image's patches, and the
end id, as transformers' processor expands it. The text around the images
is encoded without special tokens (the template placed them), piece by
piece: a tokenizer that knows those tokens splits the text there too, so the
ids are the whole text's. A template that places fewer or more images than
the messages hold is the request's error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mstar.errors import CONTEXT_EXCEEDED, RequestError
from mstar.models.prompt import chat_text
from mstar.models.qwen3_5.config import ImageTokens
from mstar.models.tokenizer import Tokenizer
from mstar.models.vision.patches import ImagePatches
from mstar.models.vision.positions import prompt_positions
from mstar.models.vision.preprocessor import PatchRecipe

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"   # an image, as the chat template writes it
TYPED_PLACEHOLDER = ("the text holds an image's placeholder tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>); "
                     "an image comes as an image_url part")


@dataclass(frozen=True)
class ImagePrompt:
    ids: list[int]
    images: list[ImagePatches]   # in the order of their placeholder runs
    positions: torch.Tensor      # [3, len(ids)] int64

    def values(self) -> dict[str, torch.Tensor]:
        """The image walk's inputs."""
        return {"prompt_ids": torch.tensor(self.ids, dtype=torch.long), "positions": self.positions,
                "image_pixels": torch.cat([p.pixel_values for p in self.images]),
                "image_grids": torch.tensor([p.grid_thw for p in self.images], dtype=torch.long)}


def has_images(inputs: Mapping[str, Any]) -> bool:
    """Whether a request's chat messages hold an image part."""
    messages = inputs.get("messages")
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return False
    return any(isinstance(part, Mapping) and part.get("type") == "image"
               for message in messages if isinstance(message, Mapping) and isinstance(message.get("content"), list)
               for part in message["content"])


def image_prompt(messages: Sequence[Any], add_generation_prompt: bool, tokenizer: Tokenizer, recipe: PatchRecipe,
                 tokens: ImageTokens, vocab_size: int, max_model_len: int,
                 variables: Mapping[str, Any] | None = None) -> ImagePrompt:
    """The prompt of `messages` (`variables`: more the chat template reads);
    `RequestError`s name the field at fault.
    Each image's token count comes from its size first, and a prompt past
    the context is refused before any image is cut into patches (a 4096 x
    4096 picture is ~400 MB of them)."""
    found: list[tuple[Any, str]] = []   # each image part's picture and field, in order
    stubbed = [_stubbed(message, m, found) for m, message in enumerate(messages)]
    grids = [recipe.grid(picture, where) for picture, where in found]
    text = chat_text(stubbed, add_generation_prompt, tokenizer, max_model_len, media=("image",), variables=variables)
    pieces = text.split(PLACEHOLDER)
    if len(pieces) - 1 > len(found):  # the template places each image once: the others were typed in the text
        raise RequestError(TYPED_PLACEHOLDER, field="messages")
    if len(pieces) - 1 != len(found):
        raise RequestError(f"the chat template placed {len(pieces) - 1} images, but the messages hold "
                           f"{len(found)}", field="messages")
    reserved = {tokens.vision_start, tokens.image, tokens.vision_end}

    def text_ids(piece: str) -> list[int]:
        out = list(tokenizer.encode(piece, add_special_tokens=False))
        if reserved.intersection(out):
            raise RequestError(TYPED_PLACEHOLDER, field="messages")
        return out
    ids = text_ids(pieces[0])
    for (t, h, w), piece in zip(grids, pieces[1:]):
        ids += [tokens.vision_start, *[tokens.image] * (t * h * w // recipe.merge_size ** 2), tokens.vision_end]
        ids += text_ids(piece)
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt is {len(ids)} tokens with its images but the model's context is "
                           f"{max_model_len} tokens, leaving no room to generate", field="messages",
                           code=CONTEXT_EXCEEDED)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", field="messages")
    images = [recipe.patches(picture, where) for picture, where in found]
    positions, _ = prompt_positions(ids, image_id=tokens.image, image_grids=grids, spatial_merge=recipe.merge_size)
    return ImagePrompt(ids, images, positions)


def _stubbed(message: Any, m: int, found: list[tuple[Any, str]]) -> Any:
    """`message` with each image part's picture (appended to `found` with
    its field) left out: `{"type": "image"}` for the template."""
    if not isinstance(message, Mapping) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for p, part in enumerate(message["content"]):
        if isinstance(part, Mapping) and part.get("type") == "image":
            where = f"messages[{m}].content[{p}]"
            if "image" not in part:
                raise RequestError("an image part brings its decoded picture as `image`", field=where)
            found.append((part["image"], where))
            part = {"type": "image"}
        parts.append(part)
    return {**message, "content": parts}
