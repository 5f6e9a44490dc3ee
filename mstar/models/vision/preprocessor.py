"""A checkpoint's image preprocessing: its folder's `preprocessor_config.json`
(the settings transformers' `Qwen2VLImageProcessor` reads) in, a
`PatchRecipe` out, which cuts a decoded picture into the vision encoder's
patches (`patches.py`).

The pixel budget comes from `size` (`shortest_edge`, `longest_edge`: the
fewest and most pixels) or the older `min_pixels` / `max_pixels`, which win
where both are given, as in transformers. The patch sizes must be the
encoder's. Settings that would change the computation in ways `patches.py`
does not follow (no resizing, another rescale factor or resampling filter)
are refused rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mstar.errors import ConfigError
from mstar.models.checkpoint import read_json
from mstar.models.vision.config import VisionEncoderConfig
from mstar.models.vision.patches import MAX_PIXELS, MEAN, MIN_PIXELS, STD, ImagePatches, image_grid, image_patches

BICUBIC = 3            # PIL's code for the filter `patches.py` resizes with
RESCALE = 1 / 255
# settings that must hold the value `patches.py` computes with, where a file gives them
_FIXED: dict[str, Any] = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                          "resample": BICUBIC, "rescale_factor": RESCALE}


@dataclass(frozen=True)
class PatchRecipe:
    """How pictures become one model's encoder input."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD

    def patches(self, image: np.ndarray | Image.Image, field: str) -> ImagePatches:
        """One decoded picture's patches; a picture no model could take is a
        `RequestError` naming `field`."""
        return image_patches(image, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                             patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                             merge_size=self.merge_size, mean=self.mean, std=self.std, field=field)

    def grid(self, image: np.ndarray | Image.Image, field: str) -> tuple[int, int, int]:
        """The grid `patches` would cut `image` into, from its size alone."""
        return image_grid(image, min_pixels=self.min_pixels, max_pixels=self.max_pixels, patch_size=self.patch_size,
                          merge_size=self.merge_size, field=field)

    @classmethod
    def for_encoder(cls, encoder: VisionEncoderConfig, min_pixels: int, max_pixels: int) -> PatchRecipe:
        """The encoder's patch sizes within a budget, mean and std 0.5 (the Qwen-VL family's)."""
        return cls(patch_size=encoder.patch_size, temporal_patch_size=encoder.temporal_patch_size,
                   merge_size=encoder.spatial_merge_size, min_pixels=min_pixels, max_pixels=max_pixels)

    @classmethod
    def read(cls, folder: Path, default: PatchRecipe) -> PatchRecipe:
        """The recipe `folder`'s preprocessor_config.json gives, `default`
        for what it leaves out (all of it without the file)."""
        file = folder / "preprocessor_config.json"
        if not file.is_file():
            return default
        data = read_json(file)
        if not isinstance(data, Mapping):
            raise ConfigError(f"{file}: must hold an object")
        return cls._from(data, default, str(file))

    @classmethod
    def _from(cls, data: Mapping[str, Any], default: PatchRecipe, where: str) -> PatchRecipe:
        for name, want in _FIXED.items():
            if name in data and data[name] != want:
                raise ConfigError(f"{where}: {name} {data[name]!r} is not supported (only {want!r})")
        size = data.get("size") if isinstance(data.get("size"), Mapping) else {}
        given = {"patch_size": data.get("patch_size"), "temporal_patch_size": data.get("temporal_patch_size"),
                 "merge_size": data.get("merge_size"),
                 # a key given as null is absent, as transformers reads it
                 "min_pixels": _first(data.get("min_pixels"), size.get("shortest_edge")),
                 "max_pixels": _first(data.get("max_pixels"), size.get("longest_edge")),
                 "mean": data.get("image_mean"), "std": data.get("image_std")}
        try:
            changes = {name: tuple(float(v) for v in value) if name in ("mean", "std") else int(value)
                       for name, value in given.items() if value is not None}
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        recipe = dataclasses.replace(default, **changes)
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(recipe, name) != getattr(default, name):
                raise ConfigError(f"{where}: {name} {getattr(recipe, name)} differs from the vision encoder's "
                                  f"{getattr(default, name)}")
        if not 0 < recipe.min_pixels <= recipe.max_pixels:
            raise ConfigError(f"{where}: the pixel budget needs 0 < shortest_edge <= longest_edge, got "
                              f"{recipe.min_pixels}, {recipe.max_pixels}")
        if len(recipe.mean) != 3 or len(recipe.std) != 3 or not all(s > 0 for s in recipe.std):
            raise ConfigError(f"{where}: image_mean and image_std must be 3 numbers each, the std positive")
        return recipe


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)
