"""VisionEncoderConfig: a checkpoint's `vision_config` dict in (Qwen3-Omni's
thinker, Qwen3.5's, both Qwen3-VL's encoder), the frozen numbers of its
vision encoder out, checked so that a shape the encoder cannot run is a
`ConfigError` at load, not a wrong answer later.

Every size must be in the dict (transformers writes them all when it saves
a config); the MLP's activation and the rotary's base may be left out and
take transformers' values. Deepstack levels are read only for a model that
feeds them to its decoder (Qwen3-Omni); Qwen3.5's tower has none, whatever
its dict lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mstar.errors import ConfigError

VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
SIZES = ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
         "spatial_merge_size", "in_channels", "out_hidden_size", "num_position_embeddings")


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int        # a square table: sqrt(n) positions a side
    deepstack_visual_indexes: tuple[int, ...] = ()   # the layers whose merged output the decoder adds
    hidden_act: str = "gelu_pytorch_tanh"   # the blocks' MLP; the mergers' GELU is always exact
    rope_theta: float = 10000.0             # the 2-D axial rotary's base

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, data: Any, where: str, *, deepstack: bool) -> VisionEncoderConfig:
        """`where` names the dict in errors (`qwen3-omni config:
        thinker_config.vision_config`); with `deepstack`, its
        `deepstack_visual_indexes` are required and read."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be an object")

        def need(name: str, kind: type = int) -> Any:
            if name not in data:
                raise ConfigError(f"{where}.{name} is missing")
            value = data[name]
            try:
                return tuple(int(v) for v in value) if kind is tuple else kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.{name} must be {kind.__name__}, got {value!r}") from None

        rope = data.get("rope_parameters")
        theta = (rope if isinstance(rope, Mapping) else {}).get("rope_theta", data.get("rope_theta", 10000.0))
        try:
            theta = float(theta)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.rope_parameters.rope_theta must be float, got {theta!r}") from None
        cfg = cls(**{name: need(name) for name in SIZES},
                  deepstack_visual_indexes=need("deepstack_visual_indexes", tuple) if deepstack else (),
                  hidden_act=str(data.get("hidden_act", "gelu_pytorch_tanh")), rope_theta=theta)
        cfg._check(where)
        return cfg

    def _check(self, where: str) -> None:
        for f in fields(self):
            if f.name in SIZES and getattr(self, f.name) <= 0:
                raise ConfigError(f"{where}.{f.name} must be positive, got {getattr(self, f.name)}")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"{where}.hidden_act {self.hidden_act!r} is not one of {', '.join(VISION_ACTIVATIONS)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(f"{where}: hidden_size {self.hidden_size} over {self.num_heads} heads must give a head "
                              "size divisible by 4 (the rotary splits it in rows and columns)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(f"{where}.num_position_embeddings {self.num_position_embeddings} is not a square")
        levels = self.deepstack_visual_indexes
        if len(set(levels)) != len(levels) or not all(0 <= i < self.depth for i in levels):
            raise ConfigError(f"{where}.deepstack_visual_indexes {list(levels)} must be distinct layers in "
                              f"0..{self.depth - 1}")
