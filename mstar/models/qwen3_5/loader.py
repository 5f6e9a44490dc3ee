"""Qwen3.5 checkpoint names in, `Qwen35Decoder` and vision tower parameters
out.

A `Qwen3_5ForCausalLM` checkpoint names the decoder `model.*`, a
`Qwen3_5ForConditionalGeneration` one `model.language_model.*` beside its
vision tower (`model.visual.*`, which `load_tower` reads), and both may
carry multi-token-prediction layers (`mtp.*`, unused). The decoder's
parameters keep the checkpoint's names but where `weight_map` merges (an
attention's q, k and v, a SwiGLU's gate and up) or stacks (experts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.models.llama.loader import dummy_param, dummy_seed
from mstar.models.qwen3_5.decoder import Qwen35Decoder
from mstar.models.vision.encoder import VisionEncoder, load_vision_encoder
from mstar.models.weight_map import Part, load_mapped

# the text decoder of a CausalLM or a ConditionalGeneration checkpoint (beside `model.visual.*`, `mtp.*`)
TEXT = Part("qwen3.5", (("model.language_model.", ""), ("model.", ""), ("lm_head.", "lm_head.")),
            ("model.language_model.", "model.embed_tokens.", "model.layers.", "model.norm.", "lm_head."))


def load_checkpoint(decoder: Qwen35Decoder, folder: str | Path) -> None:
    load_mapped(decoder, folder, TEXT)


def load_tower(tower: VisionEncoder, folder: str | Path) -> None:
    """The vision tower from the folder's `model.visual.*` tensors."""
    load_vision_encoder(tower, folder, "model.visual.", "qwen3.5 vision tower")


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
