"""The `orpheus-3b` builtin: the real Orpheus-3B shape (a Llama-3.2-3B body with
the audio-code vocabulary), served only with dummy weights, with the served
context at 8192 unless overridden. Shapes are checked on the meta device so
no 3B model is built here."""

from __future__ import annotations

import pytest
import torch
import transformers

from mstar.errors import ConfigError
from mstar.models.layers.rotary import inverse_frequencies
from mstar.models.llama import LlamaModel
from mstar.models.llama.config import ORPHEUS_3B, ORPHEUS_3B_CONFIG_JSON
from mstar.models.llama.model import LlamaDecoder
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams


def test_shape() -> None:
    c = ORPHEUS_3B
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size) == (3072, 28, 8192, 156940)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 8, 128)
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5 and c.rope_theta == 500000.0
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
        "llama3", 32.0, 1.0, 4.0, 8192)
    assert c.max_position_embeddings == 131072


def test_same_parameters_and_rope_as_transformers() -> None:
    hf_cfg = transformers.LlamaConfig(**ORPHEUS_3B_CONFIG_JSON)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    ours = LlamaDecoder(ORPHEUS_3B, max_positions=16, device="meta", dtype=torch.bfloat16)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == 3_300_867_072
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(inverse_frequencies(128, ORPHEUS_3B.rope_theta, ORPHEUS_3B.rope_scaling), hf_inv)


def test_needs_dummy_load_format() -> None:
    with pytest.raises(ConfigError, match="--load-format dummy") as e:
        load_model("orpheus-3b")
    assert "folder" in str(e.value)
    model = load_model("orpheus-3b", "dummy")
    assert isinstance(model, LlamaModel) and model.config is ORPHEUS_3B and model.load_format == "dummy"


def test_served_context() -> None:
    assert load_model("orpheus-3b", "dummy").max_model_len == 8192
    assert load_model("orpheus-3b", "dummy", max_model_len=2048).max_model_len == 2048
    assert load_model("orpheus-3b", "dummy", max_model_len=32768).max_model_len == 32768
    assert load_model("tiny-llama").max_model_len == 2048  # unchanged


def test_byte_tokenizer_fits_the_vocab() -> None:
    model = load_model("orpheus-3b", "dummy")
    tok = model.tokenizer
    assert tok is not None and tok.vocab_size <= ORPHEUS_3B.vocab_size
    spec = model.kv_spec("llm")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (28, 8, 128)
    ids = model.prepare(GenerateRequest("r", "orpheus-3b", {"prompt_ids": [256, 72, 105]},
                                        SamplingParams(max_tokens=8))).values["prompt_ids"]
    assert ids.tolist() == [256, 72, 105]
