"""Qwen35Config: a Hugging Face `qwen3_5` / `qwen3_5_moe` config.json dict in
(the text decoder's fields under `text_config`, or at the top level for a
`*_text` folder), the frozen numbers of the hybrid text decoder out, and,
where the dict has a `vision_config` (a `*ForConditionalGeneration`
checkpoint), those of the vision tower with the image tokens' ids.

Layers are gated delta nets (`linear_attention`) or gated full attention
(`full_attention`), as `layer_types` lists them (by default every
`full_attention_interval`-th layer attends). Only the attention layers keep
KV pages; each delta-net layer keeps a causal convolution's last inputs and
a recurrent state per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.errors import ConfigError
from mstar.models.vision.config import VisionEncoderConfig

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
LINEAR, FULL = "linear_attention", "full_attention"
# transformers' `Qwen3_5Config` defaults for a dict that leaves them out (the published checkpoints' ids)
IMAGE_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID = 248056, 248053, 248054


@dataclass(frozen=True)
class ImageTokens:
    image: int          # the placeholder an image's rows replace, one per merged 2x2 block of patches
    vision_start: int   # before and after each image's run of placeholders (text to the positions)
    vision_end: int


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


@dataclass(frozen=True)
class Qwen35Config:
    hidden_size: int
    intermediate_size: int             # the dense MLP's (0 in a MoE decoder)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]     # (t, h, w) frequencies of the rotary dims, interleaved
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0               # MoE (qwen3_5_moe): routed experts, 0 for a dense decoder
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionEncoderConfig | None = None   # the vision tower; None: a text-only model
    image_tokens: ImageTokens | None = None     # given with `vision`

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"qwen3.5 config: {name} must be positive, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ConfigError(f"qwen3.5 config: layer_types must give {LINEAR!r} or {FULL!r} for each of the "
                              f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"qwen3.5 config: {self.num_attention_heads} attention heads are not a multiple of "
                              f"{self.num_key_value_heads} KV heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"qwen3.5 config: {self.linear_num_value_heads} linear value heads are not a multiple "
                              f"of {self.linear_num_key_heads} key heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"qwen3.5 config: partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                              f"{self.head_dim} is not an even number of dims")
        # transformers defaults it to the 9B's (11, 11, 10) whatever the head size, and cuts it to the rotary
        # frequencies (`layers/mrope.py` does the same): a small checkpoint saved without one loads in both
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ConfigError(f"qwen3.5 config: mrope_section {list(self.mrope_section)} must be 3 numbers, "
                              f"none negative")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"qwen3.5 config: num_experts_per_tok {self.num_experts_per_tok} is outside "
                              f"1..{self.num_experts}")
        if not self.num_experts and self.intermediate_size <= 0:
            raise ConfigError("qwen3.5 config: a dense decoder needs a positive intermediate_size")
        if (self.vision is None) != (self.image_tokens is None):
            raise ConfigError("qwen3.5 config: a vision tower needs its image tokens' ids, and they need a tower")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ConfigError(f"qwen3.5 config: vision_config.out_hidden_size is {self.vision.out_hidden_size}, "
                              f"but the text decoder is {self.hidden_size} wide")
        if self.image_tokens is not None and not all(0 <= t < self.vocab_size for t in (
                self.image_tokens.image, self.image_tokens.vision_start, self.image_tokens.vision_end)):
            raise ConfigError(f"qwen3.5 config: the image tokens' ids {self.image_tokens} are not all inside the "
                              f"vocabulary of {self.vocab_size}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with KV pages, in order: a page's layer index is the position here."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def delta_layers(self) -> tuple[int, ...]:
        """The gated delta-net layers, in order: a row's state holds one entry for each."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def conv_dim(self) -> int:
        """Channels of a delta net's causal convolution: its q, k and v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Qwen35Config:
        """From a parsed config.json (its `text_config` when it has one)."""
        outer = data
        d = data.get("text_config") or data
        if not isinstance(d, Mapping):
            raise ConfigError("qwen3.5 config: text_config must be an object")
        try:
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            layers = int(d["num_hidden_layers"])
            interval = int(d.get("full_attention_interval", 4))
            types = d.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
            experts = int(d.get("num_experts") or 0)
            return cls(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d.get("intermediate_size") or 0) if not experts else 0,
                num_hidden_layers=layers,
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d["num_key_value_heads"]),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"])),
                vocab_size=int(d["vocab_size"]),
                layer_types=tuple(str(t) for t in types),
                linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
                linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
                rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
                mrope_section=tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(outer.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
                attention_bias=bool(d.get("attention_bias", False)),
                num_experts=experts,
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if experts else 0,
                moe_intermediate_size=int(d.get("moe_intermediate_size") or 0) if experts else 0,
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0) if experts else 0,
                eos_token_ids=_ids(d.get("eos_token_id", outer.get("eos_token_id"))),
                **_tower(outer),
            )
        except KeyError as e:
            raise ConfigError(f"qwen3.5 config: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"qwen3.5 config: {e}") from None


def _tower(outer: Mapping[str, Any]) -> dict[str, Any]:
    """The vision tower's fields of a composite config dict (none without a `vision_config`)."""
    if outer.get("vision_config") is None:
        return {}
    # Qwen3.5's tower has no deepstack levels (transformers builds none, whatever the dict lists)
    vision = VisionEncoderConfig.from_dict(outer["vision_config"], "qwen3.5 config: vision_config", deepstack=False)
    return {"vision": vision, "image_tokens": ImageTokens(
        image=int(outer.get("image_token_id", IMAGE_TOKEN_ID)),
        vision_start=int(outer.get("vision_start_token_id", VISION_START_TOKEN_ID)),
        vision_end=int(outer.get("vision_end_token_id", VISION_END_TOKEN_ID)))}
