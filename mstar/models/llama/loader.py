"""Checkpoint tensors in, a filled `LlamaDecoder` out.

Reads a Hugging Face folder (`model.safetensors`, or shards listed in
`model.safetensors.index.json`) one tensor at a time, casting and copying each
straight into its slot of the decoder on the target device, so host memory
holds one tensor at a time. q/k/v and gate/up land in their merged weights.
`load_format="dummy"` fills the same shapes with seeded random values instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from mstar.errors import ConfigError
from mstar.models.checkpoint import mismatch_error
from mstar.models.layers import MergedLinear
from mstar.models.llama.model import LlamaDecoder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# HF projections that live inside one of our merged weights: name -> (merged, shard)
MERGED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("mlp.gate_up", "gate"), "up_proj": ("mlp.gate_up", "up")}
RENAMED = {"mlp.down_proj": "mlp.down"}
# tensors some checkpoints carry that the decoder recomputes
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
DUMMY_STD = 0.02
DUMMY_ON_HOST_MAX = 1 << 24  # elements


class CheckpointFiles:
    """The safetensors files of a folder and which tensor lives where."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        self.where: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise ConfigError(f"{index}: cannot read the weight map: {e}") from None
            for name, file in weight_map.items():
                self.where[name] = self.folder / file
            missing = sorted({str(p.name) for p in self.where.values() if not p.is_file()})
            if missing:
                raise ConfigError(f"{self.folder}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        elif single.is_file():
            with _unreadable_names(single), safe_open(str(single), framework="pt") as f:
                self.where = {name: single for name in f.keys()}
        else:
            raise ConfigError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints load)")

    def names(self) -> set[str]:
        return set(self.where)

    def tensors(self, only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor (or those whose names `only` accepts), file by file,
        loaded lazily one at a time on the host (the others are never read)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name, file in self.where.items():
            if only is None or only(name):
                by_file.setdefault(file, []).append(name)
        for file in sorted(by_file):
            with _unreadable_names(file), safe_open(str(file), framework="pt", device="cpu") as f:
                for name in by_file[file]:
                    yield name, f.get_tensor(name)


@contextmanager
def _unreadable_names(file: Path) -> Iterator[None]:
    """A file that safetensors cannot read (a truncated download, a header
    that is not one, a tensor the index puts in the wrong shard) as a
    `ConfigError` naming the file: a sharded folder's message otherwise
    leaves the user to guess which shard is bad."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{file}: cannot read the safetensors file: {e}") from None


def checkpoint_has_lm_head(folder: str | Path) -> bool:
    return "lm_head.weight" in CheckpointFiles(folder).names()


def target_of(hf_name: str) -> tuple[str, str | None] | None:
    """Map an HF tensor name to (decoder parameter, merged shard or None);
    None for names this decoder does not know."""
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    m = re.fullmatch(r"(layers\.\d+\.)(self_attn|mlp)\.(\w+)\.(weight|bias)", name)
    if m:
        prefix, block, proj, kind = m.groups()
        if proj in MERGED:
            merged, shard = MERGED[proj]
            path = merged if merged.startswith("mlp.") else f"{block}.{merged}"
            return f"{prefix}{path}.{kind}", shard
        return f"{prefix}{RENAMED.get(f'{block}.{proj}', f'{block}.{proj}')}.{kind}", None
    if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight") or re.fullmatch(
            r"layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", name):
        return name, None
    return None


def _expected(decoder: LlamaDecoder) -> dict[tuple[str, str | None], torch.Tensor]:
    """Every (parameter, shard) slot that must be filled, with its view."""
    slots: dict[tuple[str, str | None], torch.Tensor] = {}
    modules = dict(decoder.named_modules())
    for pname, param in decoder.named_parameters():  # tied weights are listed once
        owner = modules[pname.rsplit(".", 1)[0]]
        if isinstance(owner, MergedLinear):
            for shard in owner.shard_names:
                slots[(pname, shard)] = param.data[owner.shard_rows(shard)]
        else:
            slots[(pname, None)] = param.data
    return slots


def load_weights(decoder: LlamaDecoder, folder: str | Path, progress: bool = True) -> None:
    """Fill `decoder` from the safetensors checkpoint in `folder`."""
    files = CheckpointFiles(folder)
    slots = _expected(decoder)
    filled: set[tuple[str, str | None]] = set()
    unexpected: list[str] = []
    bar = tqdm(total=len(files.where), desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for hf_name, tensor in files.tensors():
        bar.update(1)
        if IGNORED.fullmatch(hf_name):
            continue
        target = target_of(hf_name)
        if target == ("lm_head.weight", None) and decoder.tie_word_embeddings:
            continue  # tied: the embedding is the head
        if target is None or target not in slots:
            unexpected.append(hf_name)
            continue
        slot = slots[target]
        if tuple(tensor.shape) != tuple(slot.shape):
            raise ConfigError(f"{folder}: tensor '{hf_name}' has shape {tuple(tensor.shape)}, "
                              f"the config expects {tuple(slot.shape)}")
        slot.copy_(tensor)
        filled.add(target)
    bar.close()
    missing = sorted(f"{p}[{s}]" if s else p for p, s in set(slots) - filled)
    if missing or unexpected:
        raise mismatch_error(folder, "llama", missing, list(unexpected))


def dummy_weights(decoder: nn.Module, seed: int = 0) -> None:
    """Seeded random weights: normal(0, 0.02) matrices, zero biases, unit norms."""
    for i, (name, param) in enumerate(decoder.named_parameters()):
        dummy_param(param, name, dummy_seed(seed, i))


def dummy_seed(seed: int, index: int) -> int:
    """The seed `dummy_weights` draws a module's `index`-th parameter with
    (another module holding a copy of it draws the same values)."""
    return seed * 1_000_003 + index


def dummy_param(param: torch.Tensor, name: str, gen_seed: int) -> None:
    """One parameter as `dummy_weights` fills it."""
    if name.endswith("norm.weight"):
        param.data.fill_(1.0)
    elif name.endswith(".bias"):
        param.data.zero_()
    elif param.numel() > DUMMY_ON_HOST_MAX:
        # large ones are drawn in place, on the device and in the weight's
        # dtype: no float32 temporary (2 GB for a 3B model's embedding) and
        # one pass over memory instead of three
        gen = torch.Generator(device=param.device).manual_seed(gen_seed)
        param.data.normal_(0.0, DUMMY_STD, generator=gen)
    else:
        # small tensors are drawn in float32 on the host so a small model gets
        # the same weights on every device and in every dtype
        gen = torch.Generator().manual_seed(gen_seed)
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, DUMMY_STD, generator=gen)
        param.data.copy_(values)
