"""Checkpoint tensors into a module's parameters, by name: a `Part` (which
checkpoint prefixes a module's parameters come from) and a folder in, every
parameter filled out, or a `ConfigError` that lists what is missing or left
over.

A name finds its parameter in two steps: a prefix picks the part and where
in the module it lands (`talker.code_predictor.model.` -> `code_predictor.`),
then the feed-forward's pieces find their place. Experts stored one by one
(`mlp.experts.E.{gate,up,down}_proj`) are stacked into the layout the MoE
layer runs ([E, 2I, H] gate then up, [E, H, I] down); the gate and up
projections of a shared expert or a dense MLP fill the two halves of one
merged weight, an attention's q, k and v projections the three row blocks
of its `qkv` (an attention says their rows with `qkv_rows`, else they are
its heads', KV heads' and KV heads' times `head_dim`), and a module's other
merged projections the row blocks its `merged_rows` lists
({projection: ((checkpoint suffix, rows), ...)}: `in_proj` of
`in_proj_qkv`, `in_proj_z`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mstar.errors import ConfigError
from mstar.models.checkpoint import mismatch_error
from mstar.models.llama.loader import CheckpointFiles

# (expert, shard): which slice of a parameter a checkpoint tensor fills; (None, None) is all of it
Piece = tuple[int | None, str | None]
# a merged parameter's row blocks: shard -> (first row, rows)
Blocks = dict[str, tuple[int, int]]

# checkpoint MLP names (after the part's prefix) -> mstar's parameter; `expert` and `shard` name the piece
_MLP = (
    (re.compile(r"(.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<shard>gate|up)_proj\.weight"), r"\1.gate_up"),
    (re.compile(r"(.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<shard>down)_proj\.weight"), r"\1.down"),
    (re.compile(r"(.+\.mlp)\.shared_expert\.(?P<shard>gate|up)_proj\.weight"), r"\1.shared.gate_up.weight"),
    (re.compile(r"(.+\.mlp)\.shared_expert\.down_proj\.weight"), r"\1.shared.down.weight"),
    (re.compile(r"(.+\.mlp)\.shared_expert_gate\.weight"), r"\1.shared_gate.weight"),
    (re.compile(r"(.+\.mlp)\.gate\.weight"), r"\1.router"),
    (re.compile(r"(.+\.mlp)\.(?P<shard>gate|up)_proj\.weight"), r"\1.gate_up.weight"),
    (re.compile(r"(.+\.mlp)\.down_proj\.weight"), r"\1.down.weight"),
    (re.compile(r"(.+\.self_attn)\.(?P<shard>q|k|v)_proj\.(?P<kind>weight|bias)"), r"\1.qkv.\g<kind>"),
)


@dataclass(frozen=True)
class Part:
    what: str                              # as errors name it
    prefixes: tuple[tuple[str, str], ...]  # checkpoint prefix -> module prefix; the first that matches
    owned: tuple[str, ...]                 # checkpoint names under these must each fill a parameter


def _target(part: Part, name: str, merged: dict[str, tuple[str, Piece]]) -> tuple[str, Piece] | None:
    """The parameter a checkpoint tensor fills and which piece of it; None:
    not one of the part's names. `merged`: the checkpoint names of the row
    blocks of `merged_rows` projections -> (parameter, shard) as
    `_merged_names` lists them."""
    for prefix, local in part.prefixes:
        if name.startswith(prefix):
            break
    else:
        return None
    name = local + name[len(prefix):]
    if name in merged:
        return merged[name]
    for pattern, replacement in _MLP:
        match = pattern.fullmatch(name)
        if match is not None:
            groups = match.groupdict()
            expert = groups.get("expert")
            return match.expand(replacement), (None if expert is None else int(expert), groups.get("shard"))
    return name, (None, None)


def _fill(param: torch.Tensor, piece: Piece, tensor: torch.Tensor, blocks: Blocks | None) -> None:
    """`blocks`: the row blocks of a merged projection's parameter."""
    expert, shard = piece
    view = param if expert is None else param[expert]
    if shard in ("gate", "up") and blocks is None:  # both merged layouts hold gate then up, half and half
        half = view.shape[0] // 2
        view = view[:half] if shard == "gate" else view[half:]
    elif shard is not None and blocks is not None:
        start, rows = blocks[shard]
        view = view[start:start + rows]
    if view.shape != tensor.shape:
        raise ValueError(f"a checkpoint tensor of shape {tuple(tensor.shape)} cannot fill {tuple(view.shape)}")
    view.copy_(tensor)


def _expected(params: dict[str, torch.Tensor], blocks: dict[str, Blocks]) -> set[tuple[str, int | None, str | None]]:
    """What a complete checkpoint fills: each plain parameter whole, each
    merged gate/up weight by halves, each other merged one by its row
    blocks, each stacked expert parameter per expert and projection."""
    out: set[tuple[str, int | None, str | None]] = set()
    for name, p in params.items():
        stacked = ("gate", "up") if name.endswith(".gate_up") else ("down",) if name.endswith(".down") else ()
        if stacked and p.dim() == 3:
            out |= {(name, e, which) for e in range(p.shape[0]) for which in stacked}
        elif name.endswith(".gate_up.weight"):
            out |= {(name, None, "gate"), (name, None, "up")}
        elif name in blocks:
            out |= {(name, None, shard) for shard in blocks[name]}
        else:
            out.add((name, None, None))
    return out


def _stacked(shards: tuple[tuple[str, int], ...]) -> Blocks:
    out: Blocks = {}
    start = 0
    for shard, rows in shards:
        out[shard] = (start, rows)
        start += rows
    return out


def _row_blocks(module: nn.Module) -> dict[str, Blocks]:
    """Each merged projection's row blocks, by parameter name (weight and
    bias): every attention's `qkv` (an attention has `heads`, `kv_heads`
    and `head_dim`) and each projection a module's `merged_rows` names."""
    out: dict[str, Blocks] = {}
    for name, m in module.named_modules():
        merged: dict[str, tuple[tuple[str, int], ...]] = dict(getattr(m, "merged_rows", {}))
        if isinstance(getattr(m, "qkv", None), nn.Module) and hasattr(m, "kv_heads"):
            q, k, v = getattr(m, "qkv_rows", None) or (m.heads * m.head_dim, m.kv_heads * m.head_dim,
                                                       m.kv_heads * m.head_dim)
            merged["qkv"] = (("q", q), ("k", k), ("v", v))
        for projection, shards in merged.items():
            for kind in ("weight", "bias"):
                out[f"{name}.{projection}.{kind}"] = _stacked(shards)
    return out


def _merged_names(module: nn.Module) -> dict[str, tuple[str, Piece]]:
    """The checkpoint names (after a part's prefix) of the row blocks of
    `merged_rows` projections: `<module>.<projection>_<shard>.<kind>` ->
    (the merged parameter, (None, shard))."""
    return {f"{name}.{projection}_{shard}.{kind}": (f"{name}.{projection}.{kind}", (None, shard))
            for name, m in module.named_modules() for projection, shards in getattr(m, "merged_rows", {}).items()
            for shard, _ in shards for kind in ("weight", "bias")}


def load_mapped(module: nn.Module, folder: str | Path, part: Part) -> None:
    params = dict(module.named_parameters())
    blocks, merged = _row_blocks(module), _merged_names(module)
    filled: set[tuple[str, int | None, str | None]] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in CheckpointFiles(folder).tensors(lambda n: n.startswith(part.owned)):
            target = _target(part, name, merged)
            param = None if target is None else params.get(target[0])
            if target is None or param is None:
                unknown.append(name)
                continue
            try:
                _fill(param, target[1], tensor, blocks.get(target[0]))
            except ValueError as e:
                raise ConfigError(f"{part.what} checkpoint {folder}: '{name}': {e}") from e
            filled.add((target[0], *target[1]))
    missing = sorted({name for name, _, _ in _expected(params, blocks) - filled})
    if missing or unknown:
        raise mismatch_error(folder, part.what, missing, unknown)


def load_part(module: nn.Module, folder: str | Path, prefix: str, what: str) -> None:
    """Fill a part whose parameters are the checkpoint's tensors under
    `prefix`, one to one, but for each attention's q, k and v projections
    (weights and biases), which fill the row blocks of its merged `qkv`; a
    `ConfigError` (`what` names the part) lists what is missing or left over."""
    load_mapped(module, folder, Part(what, ((prefix, ""),), (prefix,)))


def fill_params(module: nn.Module, folder: str | Path, prefix: str, what: str,
                target: Callable[[str], str | None] = lambda local: local,
                adapt: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Fill a part whose parameters map one to one onto checkpoint tensors
    (the encoders, code2wav) from the tensors under `prefix`, reading only
    those: `target` names the parameter a tensor fills (its name past the
    prefix in; None: no parameter), `adapt(name, tensor, param)` may reshape
    it first. A `ConfigError` (`what` names the part) lists the parameters
    nothing filled and the tensors that fill nothing, or fit nothing."""
    params = dict(module.named_parameters())
    filled: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in CheckpointFiles(folder).tensors(lambda n: n.startswith(prefix)):
            local = target(name[len(prefix):])
            param = params.get(local) if local is not None else None
            if param is not None and adapt is not None:
                tensor = adapt(name, tensor, param)
            if param is None or param.shape != tensor.shape:
                unknown.append(name if param is None else f"{name} {list(tensor.shape)}")
                continue
            param.copy_(tensor)
            filled.add(local)
    missing = sorted(set(params) - filled)
    if missing or unknown:
        raise mismatch_error(folder, what, missing, unknown)
