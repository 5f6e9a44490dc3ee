"""One picture in (an RGB uint8 array [H, W, 3] or a PIL image), the vision
encoder's input out: the picture resized to whole 2x2 blocks of 16-pixel
patches within a pixel budget, scaled to [-1, 1], and cut into flattened
patches ([patches, 3 * 2 * 16 * 16] float32, each patch channel-major with
its one frame repeated over the two temporal slots) in merge-block order,
with the grid (1, h, w) in patches.

This is what transformers' `Qwen2VLImageProcessor` gives with a checkpoint's
preprocessor settings (Qwen3-Omni's are the defaults here; a folder's own
come through `preprocessor.py`), through its PIL backend (the one it takes
without torchvision): Pillow's bicubic resize of the 8-bit picture, then
float arithmetic in the same order, so the values are bit for bit the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from mstar.errors import RequestError

# The Qwen3-Omni checkpoints' preprocessor_config.json (transformers' class
# defaults are Qwen2-VL's: patch 14, CLIP mean and std, at most 1003520 pixels)
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 3136        # 56 * 56
MAX_PIXELS = 12845056    # 3584 * 3584
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
MAX_ASPECT = 200         # transformers refuses a longer side over 200 times the shorter


@dataclass(frozen=True)
class ImagePatches:
    """One image as the vision encoder takes it."""

    pixel_values: torch.Tensor       # [t * h * w, channels * temporal * patch ** 2] float32
    grid_thw: tuple[int, int, int]   # (t, h, w) in patches; t is 1 for a picture
    merge_size: int

    @property
    def tokens(self) -> int:
        """The encoder rows (and thinker placeholders) this image makes."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size ** 2


def resized_size(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) in pixels, multiples of `factor`: the nearest to the
    picture's own, scaled down (floor) to at most `max_pixels` or up (ceil)
    to at least `min_pixels`, keeping the aspect ratio as near as whole
    blocks allow."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _rgb(image: np.ndarray | Image.Image) -> Image.Image:
    """The picture as an 8-bit RGB PIL image; transparency over white."""
    if isinstance(image, np.ndarray):
        return Image.fromarray(np.ascontiguousarray(image))
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_grid(image: np.ndarray | Image.Image, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
               patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
               field: str = "image") -> tuple[int, int, int]:
    """The grid (t, h, w) in patches that `image_patches` cuts `image` into,
    from its size alone (no pixel is read): a prompt counts its tokens before
    paying for the patches. A picture with an empty side or a longer side
    over 200 times the shorter is a `RequestError` naming `field`
    (transformers refuses the same ones)."""
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"the pixel budget needs 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    if isinstance(image, Image.Image):
        width, height = image.size
    elif isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        height, width = image.shape[:2]
    else:
        raise TypeError(f"an image is a PIL image or a uint8 array [H, W, 3], not {type(image).__name__} "
                        f"{getattr(image, 'shape', '')}")
    if min(width, height) < 1:
        raise RequestError(f"the image is {width}x{height} pixels; it needs at least one pixel a side", field=field)
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise RequestError(f"the image is {width}x{height} pixels; its longer side may be at most {MAX_ASPECT} "
                           "times its shorter", field=field)
    new_height, new_width = resized_size(height, width, factor=patch_size * merge_size, min_pixels=min_pixels,
                                         max_pixels=max_pixels)
    return 1, new_height // patch_size, new_width // patch_size


def image_patches(image: np.ndarray | Image.Image, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                  patch_size: int = PATCH_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
                  merge_size: int = MERGE_SIZE, mean: Sequence[float] = MEAN, std: Sequence[float] = STD,
                  field: str = "image") -> ImagePatches:
    """The encoder input of one picture; what `image_grid` refuses is refused."""
    _, h, w = image_grid(image, min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                         merge_size=merge_size, field=field)
    new_height, new_width = h * patch_size, w * patch_size
    picture = _rgb(image)
    resized = np.asarray(picture.resize((new_width, new_height), Image.Resampling.BICUBIC))
    # float64 scaling rounded to float32, then float32 centring: transformers' order, bit for bit
    pixels = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    m, p = merge_size, patch_size
    # [H, W, C] -> (block row, block col, row in block, col in block, C, pixel row, pixel col)
    blocks = pixels.reshape(h // m, m, p, w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal_patch_size, p, p))
    flat = np.ascontiguousarray(frames).reshape(h * w, 3 * temporal_patch_size * p * p)
    return ImagePatches(pixel_values=torch.from_numpy(flat), grid_thw=(1, h, w), merge_size=merge_size)
