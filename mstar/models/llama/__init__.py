"""The Llama family as a served model: a request's prompt (token ids, text or
chat messages, tokenised here) in, a walk that prefills it and decodes token
by token until EOS or the token budget.

`LlamaModel(name, path, ...)` reads a Hugging Face folder (config.json,
safetensors, tokenizer files); `path=None` is the builtin tiny config with the
byte tokenizer and seeded random weights. `path=None, builtin=<LlamaConfig>` is
a named architecture without a bundled checkpoint (orpheus-3b): it serves only
with `load_format="dummy"`, with the byte tokenizer (every byte id is inside
the vocabulary; the real Orpheus tokenizer comes with the Orpheus model).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar.errors import ConfigError
from mstar.graph import Component
from mstar.models.base import KVSpec, text_walk
from mstar.models.checkpoint import check_load_format, generation_eos
from mstar.models.language import LanguageModel
from mstar.models.llama.config import TINY_LLAMA, LlamaConfig, read_config_json
from mstar.models.llama.loader import checkpoint_has_lm_head, dummy_weights, load_weights
from mstar.models.llama.model import LlamaDecoder
from mstar.models.prepared import PreparedPiece
from mstar.models.prompt import prompt_tokens
from mstar.models.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, Tokenizer, builtin_byte_tokenizer
from mstar.types import GenerateRequest, SamplingParams

DUMMY_SEED = 0

log = logging.getLogger(__name__)

__all__ = ["LlamaConfig", "LlamaDecoder", "LlamaModel"]


class LlamaModel(LanguageModel):
    components = {"llm": Component(modes=("prefill", "decode"), kv_cache=True, samples=True)}
    walks = {
        "generate": text_walk("llm"),
    }
    default_walk = "generate"

    def __init__(self, name: str, path: str | None, load_format: str = "auto",
                 max_model_len: int | None = None, *, builtin: LlamaConfig | None = None,
                 default_max_model_len: int | None = None) -> None:
        """`builtin`: the architecture of a checkpoint-less builtin (needs
        `load_format="dummy"`); `default_max_model_len`: the served context
        when `max_model_len` is None (default: max_position_embeddings)."""
        super().__init__(name)
        check_load_format(load_format)
        if max_model_len is not None and max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {max_model_len}")
        self.path = Path(path) if path is not None else None
        self._generation_eos: tuple[int, ...] = ()
        if self.path is None and builtin is not None:
            if load_format != "dummy":
                raise ConfigError(f"model '{name}' has no bundled checkpoint: pass a local Hugging Face folder "
                                  f"as the model, or --load-format dummy for random weights of its shape")
            if builtin.vocab_size < BYTE_TOKENIZER_VOCAB_SIZE:
                raise ConfigError(f"model '{name}': vocab {builtin.vocab_size} is smaller than the byte "
                                  f"tokenizer's {BYTE_TOKENIZER_VOCAB_SIZE}")
            self.config = builtin
            self.load_format = load_format
            self._tokenizer = builtin_byte_tokenizer()
        elif self.path is None:
            # the builtin model has no checkpoint: its weights are always seeded random
            self.config = TINY_LLAMA
            self.load_format = "dummy"
            self._tokenizer: Tokenizer | None = builtin_byte_tokenizer()
        else:
            raw = read_config_json(self.path)
            if raw.get("model_type") != "llama":
                raise ConfigError(f"{self.path}: model_type is '{raw.get('model_type')}', not 'llama'")
            try:
                self.config = LlamaConfig.from_dict(raw)
            except ConfigError as e:
                raise ConfigError(f"{self.path / 'config.json'}: {e}") from None
            self.load_format = load_format
            self._tokenizer = self.folder_tokenizer(self.path)
            self._generation_eos = generation_eos(self.path)
        if max_model_len is not None and max_model_len > self.config.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_model_len} is more than model '{name}' supports "
                              f"({self.config.max_position_embeddings} positions)")
        self._max_model_len = max_model_len or default_max_model_len or self.config.max_position_embeddings

    # -- what the runtime reads (and `LanguageModel`'s)
    def kv_spec(self, component: str) -> KVSpec:
        if component != "llm":
            return super().kv_spec(component)
        c = self.config
        return KVSpec(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                      num_q_heads=c.num_attention_heads)

    # -- what the runtime calls
    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> LlamaDecoder:
        if component != "llm":
            raise ConfigError(f"model '{self.name}' has no component '{component}'")
        tie = self.config.tie_word_embeddings
        if not tie and self.load_format != "dummy" and self.path is not None and not checkpoint_has_lm_head(self.path):
            # served, as checkpoints that save a tied head once are; said, since an untied model's head is then wrong
            log.warning("%s: no lm_head.weight though config.json unties it: the head is the embedding", self.path)
            tie = True
        # positions never pass the served length: tables for 128k positions
        # would cost 128 MiB of device memory for nothing
        max_positions = self._max_model_len
        decoder = LlamaDecoder(self.config, max_positions=max_positions, tie_word_embeddings=tie,
                               device=device, dtype=dtype)
        if self.load_format == "dummy":
            dummy_weights(decoder, seed=DUMMY_SEED)
        else:
            assert self.path is not None
            load_weights(decoder, self.path)
        return decoder.eval()

    def prepare_inputs(self, request: GenerateRequest, sampling: SamplingParams) -> PreparedPiece:
        """`prompt_ids`, a text `prompt` or chat `messages` (`prompt.py`) ->
        `{"prompt_ids"}`; the context fit is `Model.prepare`'s."""
        return self.prompt_piece(request.inputs)

    def prompt_piece(self, inputs: Mapping[str, Any], field: str | None = None) -> PreparedPiece:
        """The prompt of `inputs` (one of `prompt_ids`, `prompt`, `messages`)
        as `{"prompt_ids"}`, checked against the vocabulary (a bad id names
        the input it came from); `field`: the input a prompt that does not
        fit the context names (default: that one too)."""
        ids, named = prompt_tokens(inputs, self.tokenizer, self.config.vocab_size, self._max_model_len, self.name)
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids), field or named)
