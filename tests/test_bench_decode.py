"""bench_decode.py's arithmetic: the bytes a decode step reads must match the
decoder's real parameters, and the transformers config built from ours must
be the same architecture (so the comparison is like for like)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from decode_measures import hf_config_dict, kv_bytes_per_step, weight_bytes_per_step  # noqa: E402

from mstar.models.base import KVSpec  # noqa: E402
from mstar.models.llama.config import ORPHEUS_3B, TINY_LLAMA, LlamaConfig  # noqa: E402
from mstar.models.llama.model import LlamaDecoder  # noqa: E402

BIASED = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=100, attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("cfg", [ORPHEUS_3B, TINY_LLAMA, BIASED], ids=["orpheus", "tiny", "biased"])
def test_weight_bytes_match_the_decoder(cfg: LlamaConfig) -> None:
    decoder = LlamaDecoder(cfg, max_positions=4, device="meta", dtype=torch.bfloat16)
    params = sum(p.numel() for p in decoder.parameters())  # a tied head is listed once
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size  # an untied embedding is gathered, not read whole
    assert weight_bytes_per_step(cfg, 2) == 2 * params


@pytest.mark.parametrize("cfg", [ORPHEUS_3B, TINY_LLAMA, BIASED], ids=["orpheus", "tiny", "biased"])
def test_transformers_config_is_the_same_shape(cfg: LlamaConfig) -> None:
    hf_cfg = transformers.LlamaConfig(**hf_config_dict(cfg))
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    ours = LlamaDecoder(cfg, max_positions=4, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())


def test_kv_bytes() -> None:
    # Orpheus: 28 layers x 8 KV heads x 128 x K,V x bf16 = 112 KiB per token
    spec = KVSpec(num_layers=28, num_kv_heads=8, head_dim=128)
    assert kv_bytes_per_step(spec, torch.bfloat16, batch=64, context=1000) == 64 * 1000 * 112 * 1024
