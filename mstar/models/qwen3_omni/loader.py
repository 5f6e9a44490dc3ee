"""Qwen3-Omni weights from a Hugging Face folder (safetensors, as
transformers saves `Qwen3OmniMoeForConditionalGeneration`): checkpoint names
in, the parameters of mstar's modules filled. Experts are stored one by one
(`mlp.experts.E.{gate,up,down}_proj`) and stacked here into the layout the
MoE layer runs ([E, 2I, H] gate then up, [E, H, I] down).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mstar.models.checkpoint import mismatch_error
from mstar.models.llama.loader import CheckpointFiles
from mstar.models.qwen3_omni.thinker import ThinkerDecoder

_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_THINKER = "thinker.model."


def _thinker_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """The decoder parameter a checkpoint tensor fills, and for an expert's
    projection (expert, which); None: not the thinker's text decoder."""
    if name == "thinker.lm_head.weight":
        return "lm_head.weight", None
    if not name.startswith(_THINKER):
        return None
    local = name[len(_THINKER):]
    expert = _EXPERT.fullmatch(local)
    if expert is not None:
        layer, e, which = expert.groups()
        return f"layers.{layer}.mlp.{'down' if which == 'down' else 'gate_up'}", (int(e), which)
    if local.endswith(".mlp.gate.weight"):
        return local.replace(".mlp.gate.weight", ".mlp.router"), None
    if local.startswith(("embed_tokens.", "norm.", "layers.")):
        return local, None
    return None


def load_thinker(decoder: ThinkerDecoder, folder: str | Path) -> None:
    """Fill `decoder` from `folder`; a `ConfigError` names what is missing
    or left over."""
    params = dict(decoder.named_parameters())
    filled: set[tuple[str, int | None, str | None]] = set()
    unknown: list[str] = []
    inter = decoder.cfg.moe_intermediate_size
    with torch.no_grad():
        for name, tensor in CheckpointFiles(folder).tensors():
            target = _thinker_target(name)
            if target is None:
                if name.startswith(_THINKER):
                    unknown.append(name)
                continue
            param_name, expert = target
            param = params.get(param_name)
            if param is None:
                unknown.append(name)
                continue
            if expert is None:
                param.copy_(tensor)
                filled.add((param_name, None, None))
                continue
            e, which = expert
            rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[which]
            param[e, rows].copy_(tensor)
            filled.add((param_name, e, which))
    missing = sorted({name for name, _, _ in _expected(params) - filled})
    if missing or unknown:
        raise mismatch_error(folder, "qwen3-omni thinker", missing, unknown)


def _expected(params: dict[str, torch.Tensor]) -> set[tuple[str, int | None, str | None]]:
    """What a complete checkpoint fills: each plain parameter whole, and each
    stacked expert parameter per expert and projection."""
    out: set[tuple[str, int | None, str | None]] = set()
    for name, p in params.items():
        stacked = ("gate", "up") if name.endswith(".gate_up") else ("down",) if name.endswith(".down") else ()
        if stacked and p.dim() == 3:
            out |= {(name, e, which) for e in range(p.shape[0]) for which in stacked}
        else:
            out.add((name, None, None))
    return out
