"""LlamaConfig: a Hugging Face config.json dict in, the frozen architecture
numbers the decoder and its loader need out.

Reads both the transformers 4 form (`rope_theta` + `rope_scaling`) and the
transformers 5 form (`rope_parameters` holding `rope_theta` and the scaling).
Also holds the builtin architectures: TINY_LLAMA and ORPHEUS_3B.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError
from mstar.models.checkpoint import read_json
from mstar.models.layers.rotary import RopeScaling

LLAMA_MODEL_TYPES = ("llama",)


def _ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` may be absent, one int, or a list of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"llama config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"llama config: num_attention_heads ({self.num_attention_heads}) is not a "
                              f"multiple of num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """From a parsed config.json; missing optional keys take HF's defaults."""
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            max_pos = int(d.get("max_position_embeddings", 2048))
            rope_params = d.get("rope_parameters") or {}
            # transformers 5 nests theta inside rope_parameters; older configs keep it top level
            theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
            scaling = RopeScaling.from_dict(d.get("rope_scaling") or rope_params, max_pos)
            return cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta if theta is not None else 10000.0),
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_ids(d.get("eos_token_id")),
            )
        except KeyError as e:
            raise ConfigError(f"llama config: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"llama config: {e}") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> LlamaConfig:
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict, or a `ConfigError` saying why not."""
    return read_json(Path(path) / "config.json")


def tiny_llama_config() -> LlamaConfig:
    """The builtin tiny config, sized to the builtin byte tokenizer."""
    # imported here so the config module stays cheap for callers that never use it
    from mstar.models.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, BYTE_TOKENIZER_BOS, BYTE_TOKENIZER_EOS

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=BYTE_TOKENIZER_VOCAB_SIZE,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=BYTE_TOKENIZER_BOS,
        eos_token_ids=BYTE_TOKENIZER_EOS,
    )


TINY_LLAMA: LlamaConfig = tiny_llama_config()


# Orpheus-3B (canopylabs/orpheus-3b-0.1-ft) is a Llama-3.2-3B body whose
# vocabulary grows from 128,256 to 156,940 with the SNAC audio-code tokens.
# Kept in config.json form so the bench can hand the same dict to transformers.
ORPHEUS_3B_CONFIG_JSON: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 156940,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
}
ORPHEUS_3B: LlamaConfig = LlamaConfig.from_dict(ORPHEUS_3B_CONFIG_JSON)
# served context by default: the rope's original window, and what Orpheus
# requests need; 131072 would only size KV admission checks for no use
ORPHEUS_3B_MAX_MODEL_LEN = 8192
