"""Qwen3.5 checkpoint names in, `Qwen35Decoder` parameters out.

A `Qwen3_5ForCausalLM` checkpoint names the decoder `model.*`, a
`Qwen3_5ForConditionalGeneration` one `model.language_model.*` beside its
vision tower (`model.visual.*`, not served yet) and both may carry
multi-token-prediction layers (`mtp.*`, unused). Parameters keep the
checkpoint's names but for the MLP's gate and up projections, which share
one merged weight.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mstar.models.llama.loader import dummy_param, dummy_seed, load_weights
from mstar.models.qwen3_5.decoder import Qwen35Decoder

SKIPPED = re.compile(r"(model\.visual\.|mtp\.).*")
PREFIXES = ("model.language_model.", "model.")
MLP = {"gate_proj": ("mlp.gate_up", "gate"), "up_proj": ("mlp.gate_up", "up"), "down_proj": ("mlp.down", None)}


def target_of(hf_name: str) -> tuple[str, str | None] | None:
    """(decoder parameter, merged shard or None) of a checkpoint tensor;
    ("", None) for one the model skips."""
    if SKIPPED.fullmatch(hf_name):
        return "", None
    name = next((hf_name[len(p):] for p in PREFIXES if hf_name.startswith(p)), hf_name)
    m = re.fullmatch(r"(layers\.\d+\.)mlp\.(\w+)\.weight", name)
    if m and m.group(2) in MLP:
        path, shard = MLP[m.group(2)]
        return f"{m.group(1)}{path}.weight", shard
    return name, None


def load_checkpoint(decoder: Qwen35Decoder, folder: str | Path) -> None:
    load_weights(decoder, folder, target=target_of, model="qwen3.5")


def dummy_weights(decoder: Qwen35Decoder, seed: int = 0) -> None:
    """Seeded random weights; a delta net's decay parameters as a checkpoint's
    range them (A in [1, 16], dt_bias 1), so the recurrence neither explodes
    nor forgets at once."""
    for i, (name, param) in enumerate(decoder.named_parameters()):
        if name.endswith("A_log"):
            gen = torch.Generator().manual_seed(dummy_seed(seed, i))
            param.data.copy_(torch.empty(param.shape).uniform_(1, 16, generator=gen).log())
        elif name.endswith("dt_bias"):
            param.data.fill_(1.0)
        elif name.endswith("layernorm.weight") or name.endswith("_norm.weight") or name == "norm.weight":
            param.data.zero_()   # stored as offsets from one
        else:
            dummy_param(param, name, dummy_seed(seed, i))
