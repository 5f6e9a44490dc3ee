"""Qwen3.5 as a served model: a request's prompt (token ids, text or chat
messages) in, a walk that prefills it and decodes token by token until EOS
or the token budget.

The `llm` component keeps KV pages for its attention layers and a slot of
per-row state for its delta-net layers (`Component(state=True)`): the
runtime allocates the slot when the row starts, frees it when the row ends
and swaps it out and back with the row's pages under preemption. No prefix
cache serves such rows (a cached prefix of KV would leave the recurrent
state empty); their decode steps replay CUDA graphs with the rows' slots.

`Qwen35Model(name, path, ...)` reads a Hugging Face folder (`qwen3_5` or
`qwen3_5_moe` config.json, safetensors, tokenizer); `path=None` with a
builtin config dict serves that shape with seeded random weights
(`qwen3.5-tiny` on the CPU; real shapes with `--load-format dummy`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar.errors import ConfigError
from mstar.graph import Component
from mstar.models.base import KVSpec, StateSpec, text_walk
from mstar.models.checkpoint import check_load_format, generation_eos, read_json
from mstar.models.language import LanguageModel
from mstar.models.prepared import PreparedPiece
from mstar.models.prompt import prompt_tokens
from mstar.models.qwen3_5.config import MODEL_TYPES, Qwen35Config
from mstar.models.qwen3_5.decoder import Qwen35Decoder
from mstar.models.qwen3_5.loader import dummy_weights, load_checkpoint
from mstar.models.tokenizer import Tokenizer, builtin_byte_tokenizer
from mstar.types import GenerateRequest, SamplingParams

DUMMY_SEED = 0


class Qwen35Model(LanguageModel):
    components = {"llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True, state=True)}
    walks = {"generate": text_walk("llm")}
    default_walk = "generate"

    def __init__(self, name: str, path: str | None, load_format: str = "auto", max_model_len: int | None = None,
                 *, builtin: dict[str, Any] | None = None) -> None:
        """`builtin`: the config.json dict of a checkpoint-less shape (random
        weights; with the byte tokenizer)."""
        super().__init__(name)
        check_load_format(load_format)
        self.path = Path(path) if path is not None else None
        self._generation_eos: tuple[int, ...] = ()
        if self.path is None:
            assert builtin is not None, "a Qwen3.5 model without a folder needs a builtin shape"
            self.config = Qwen35Config.from_dict(builtin)
            self.load_format = "dummy"
            self._tokenizer: Tokenizer | None = builtin_byte_tokenizer()
        else:
            raw = read_json(self.path / "config.json")
            if raw.get("model_type") not in MODEL_TYPES:
                raise ConfigError(f"{self.path}: model_type is '{raw.get('model_type')}', not one of {MODEL_TYPES}")
            try:
                self.config = Qwen35Config.from_dict(raw)
            except ConfigError as e:
                raise ConfigError(f"{self.path / 'config.json'}: {e}") from None
            self.load_format = load_format
            self._tokenizer = self.folder_tokenizer(self.path)
            self._generation_eos = generation_eos(self.path)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise ConfigError(f"--max-model-len {max_model_len} is outside 1..{limit} for model '{name}'")
        self._max_model_len = max_model_len or limit

    # -- what the runtime reads (and `LanguageModel`'s)
    def kv_spec(self, component: str) -> KVSpec:
        if component != "llm":
            return super().kv_spec(component)
        c = self.config
        return KVSpec(num_layers=len(c.attention_layers), num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                      num_q_heads=c.num_attention_heads)

    def state_spec(self, component: str) -> StateSpec:
        """Per row, for each delta-net layer: the convolution's last K - 1
        inputs and the recurrent state, both float32 (a bfloat16 input is
        exact in float32; the recurrence accumulates over the whole context)."""
        c = self.config
        layers = len(c.delta_layers)
        return StateSpec((
            ("conv", (layers, c.conv_dim, c.linear_conv_kernel_dim - 1), torch.float32),
            ("rec", (layers, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
             torch.float32),
        ))

    # -- what the runtime calls
    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> Qwen35Decoder:
        if component != "llm":
            raise ConfigError(f"model '{self.name}' has no component '{component}'")
        decoder = Qwen35Decoder(self.config, device=device, dtype=dtype)
        if self.load_format == "dummy":
            dummy_weights(decoder, seed=DUMMY_SEED)
        else:
            assert self.path is not None
            load_checkpoint(decoder, self.path)
        return decoder.eval()

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        ids, field = prompt_tokens(request.inputs, self.tokenizer, self.config.vocab_size, self._max_model_len,
                                   self.name)
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids), field)
