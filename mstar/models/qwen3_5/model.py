"""Qwen3.5 as a served model: a request's prompt (token ids, text or chat
messages, whose parts may hold decoded images when the model has its vision
tower) in, the walk that serves it (`walks.py`: `generate`, or
`generate+image` for a chat with images) and its starting values out.

The `llm` component keeps KV pages for its attention layers and a slot of
per-row state for its delta-net layers (`Component(state=True)`): the
runtime allocates the slot when the row starts, frees it when the row ends
and swaps it out and back with the row's pages under preemption. No prefix
cache serves such rows (a cached prefix of KV would leave the recurrent
state empty); their decode steps replay CUDA graphs with the rows' slots.
The `vision` component (a `qwen3_5` / `qwen3_5_moe` folder's tower) turns an
image prompt's patches into rows for its placeholders.

`Qwen35Model(name, path, ...)` reads a Hugging Face folder (`qwen3_5` or
`qwen3_5_moe` config.json, safetensors, tokenizer, preprocessor_config.json);
`path=None` with a builtin config dict serves that shape with seeded random
weights (`qwen3.5-tiny`, `qwen3.5-vl-tiny` on the CPU; real shapes with
`--load-format dummy`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar.errors import ConfigError
from mstar.models.base import KVSpec, StateSpec
from mstar.models.checkpoint import check_load_format, generation_eos, read_json
from mstar.models.language import LanguageModel
from mstar.models.llama.loader import dummy_weights as plain_dummy_weights
from mstar.models.prepared import PreparedPiece
from mstar.models.prompt import generation_prompt, need_tokenizer, prompt_tokens, template_variables
from mstar.models.qwen3_5 import walks
from mstar.models.qwen3_5.builtins import BUILTIN_CHAT_TEMPLATE
from mstar.models.qwen3_5.config import MODEL_TYPES, Qwen35Config
from mstar.models.qwen3_5.decoder import Qwen35Decoder
from mstar.models.qwen3_5.image_prompt import has_images, image_prompt
from mstar.models.qwen3_5.loader import dummy_weights, load_checkpoint, load_tower
from mstar.models.tokenizer import Tokenizer, builtin_byte_tokenizer
from mstar.models.vision.encoder import VisionEncoder
from mstar.models.vision.encoding import VisionEncoding
from mstar.models.vision.preprocessor import PatchRecipe
from mstar.types import GenerateRequest, SamplingParams

DUMMY_SEED = 0
# Qwen3-VL's published preprocessor_config.json pixel budget, for a folder without one and the builtins
MIN_PIXELS, MAX_PIXELS = 65536, 16777216


class Qwen35Model(LanguageModel):
    default_walk = walks.GENERATE

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
            # a tower's builtin shows its images to a template that places them
            self._tokenizer: Tokenizer | None = builtin_byte_tokenizer(
                BUILTIN_CHAT_TEMPLATE if self.config.vision is not None else None)
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
        self.components = walks.components(self.config)
        self.walks = walks.walks(self.config)
        if self.config.vision is not None:
            self.input_modalities = ("text", "image")
            budget = PatchRecipe.for_encoder(self.config.vision, MIN_PIXELS, MAX_PIXELS)
            self.patch_recipe = budget if self.path is None else PatchRecipe.read(self.path, budget)

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
    def walk_for(self, request: GenerateRequest) -> str:
        """`generate`, or `generate+image` for a chat with images (to a model with its tower)."""
        asked = request.walk or self.default_walk
        if asked in (walks.GENERATE, walks.GENERATE_IMAGE) and self.config.vision is not None:
            return walks.GENERATE_IMAGE if has_images(request.inputs) else walks.GENERATE
        return asked

    def build_component(self, component: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        if component == "vision" and self.config.vision is not None:
            tower = VisionEncoder(self.config.vision, device=device, dtype=dtype)
            if self.load_format == "dummy":
                plain_dummy_weights(tower, seed=DUMMY_SEED)
            else:
                assert self.path is not None
                load_tower(tower, self.path)
            return VisionEncoding(tower.eval())
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
        if self.walk_for(request) == walks.GENERATE_IMAGE:
            assert self.config.image_tokens is not None
            prompt = image_prompt(request.inputs["messages"], generation_prompt(request.inputs),
                                  need_tokenizer(self.tokenizer, self.name), self.patch_recipe,
                                  self.config.image_tokens, self.config.vocab_size, self._max_model_len,
                                  template_variables(request.inputs))
            return PreparedPiece(prompt.values(), len(prompt.ids), "messages")
        ids, field = prompt_tokens(request.inputs, self.tokenizer, self.config.vocab_size, self._max_model_len,
                                   self.name)
        return PreparedPiece({"prompt_ids": torch.tensor(ids, dtype=torch.long)}, len(ids), field)
