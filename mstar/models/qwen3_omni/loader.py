"""Qwen3-Omni weights from a Hugging Face folder (safetensors, as
transformers saves `Qwen3OmniMoeForConditionalGeneration`): the parts of its
checkpoint that fill the thinker's text decoder, its vision encoder (under
`thinker.visual.`) and the talker with its code predictor (`weight_map.py`
does the filling).
"""

from __future__ import annotations

from pathlib import Path

from mstar.models.qwen3_omni.speech.talker import TalkerDecoder
from mstar.models.qwen3_omni.thinker import ThinkerDecoder
from mstar.models.vision.encoder import VisionEncoder, load_vision_encoder
from mstar.models.weight_map import Part, load_mapped

_THINKER = Part("qwen3-omni thinker", (("thinker.lm_head.", "lm_head."), ("thinker.model.", "")),
                ("thinker.model.", "thinker.lm_head."))
_TALKER = Part("qwen3-omni talker",
               (("talker.model.", ""), ("talker.code_predictor.model.", "code_predictor."),
                ("talker.code_predictor.lm_head.", "code_predictor.lm_head."), ("talker.", ""),
                ("thinker.model.embed_tokens.", "thinker_embed.")),  # the talker's copy of the thinker's table
               ("talker.", "thinker.model.embed_tokens."))


def load_thinker(decoder: ThinkerDecoder, folder: str | Path) -> None:
    """Fill `decoder` from `folder`; a `ConfigError` names what is missing
    or left over."""
    load_mapped(decoder, folder, _THINKER)


def load_talker(talker: TalkerDecoder, folder: str | Path) -> None:
    """Fill `talker` (its code predictor and its copy of the thinker's
    embedding table with it) from `folder`; a `ConfigError` names what is
    missing or left over."""
    load_mapped(talker, folder, _TALKER)


def load_vision(encoder: VisionEncoder, folder: str | Path) -> None:
    """Fill the vision encoder from `folder`'s `thinker.visual.*` tensors; a
    `ConfigError` names what is missing or left over."""
    load_vision_encoder(encoder, folder, "thinker.visual.", "qwen3-omni vision encoder")
