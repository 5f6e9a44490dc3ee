"""A snac checkpoint folder in, a filled `SnacDecoder` out.

Reads what `snac.SNAC.from_pretrained` reads: config.json plus
pytorch_model.bin (loaded with `weights_only=True`), or instead any
`*.safetensors` files in the folder. Parameter names are the package's
(`quantizer.quantizers.{i}.*`, `decoder.model.{j}.*`); weight-normalised convs
come as (g, v) pairs, either `weight_g`/`weight_v` (torch's old weight_norm)
or `parametrizations.weight.original0/1` (the new one), or already folded as
`weight`. Each pair is folded here, in float32, into the plain conv weight
w = g * v / ||v|| (norm over all but dim 0, as the package's weight_norm
computes it), then cast to the decoder's dtype. Encoder tensors, and the
quantizer's encode-side `in_proj`, are ignored: only the decoder is built.
`load_format="dummy"` fills the same shapes with seeded random values instead.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from torch import nn

from mstar.errors import ConfigError
from mstar.models.checkpoint import check_load_format, mismatch_error
from mstar.models.snac.config import SNAC_24KHZ, SnacConfig, read_config
from mstar.models.snac.model import SnacDecoder

Device = torch.device | str | None
BIN_FILE = "pytorch_model.bin"
# checkpoint tensors the decode side never reads (the attention's inv_freq is rebuilt from the config)
IGNORED = re.compile(r"encoder\..*|quantizer\.quantizers\.\d+\.in_proj\..*|decoder\.model\.\d+\.rel_pos\.inv_freq")
# the two namings of a weight-normalised conv's (g, v); a plain `weight` is tried after them
WEIGHT_NORM_FORMS = (("parametrizations.weight.original0", "parametrizations.weight.original1"),
                     ("weight_g", "weight_v"))


def package_modules(cfg: SnacConfig) -> dict[str, str]:
    """Our module path -> the package's module path, for every module that
    owns parameters. Mirrors how `snac.layers.Decoder` numbers its
    `nn.Sequential` for this config (depthwise stem, attention, noise)."""
    names: dict[str, str] = {}
    for i in range(cfg.num_levels):
        names[f"levels.{i}.codebook"] = f"quantizer.quantizers.{i}.codebook"
        names[f"levels.{i}.out_proj"] = f"quantizer.quantizers.{i}.out_proj"
    j = 0
    if cfg.depthwise:
        names["stem_depthwise"] = "decoder.model.0"
        j = 1
    names["stem"] = f"decoder.model.{j}"
    j += 1
    if cfg.attn_window_size is not None:
        for ours, theirs in (("norm", "norm"), ("qkv", "to_qkv"), ("out", "to_out")):
            names[f"attention.{ours}"] = f"decoder.model.{j}.{theirs}"
        j += 1
    for b in range(len(cfg.decoder_rates)):
        block = f"decoder.model.{j}.block"
        names[f"blocks.{b}.snake"] = f"{block}.0"
        names[f"blocks.{b}.upsample"] = f"{block}.1"
        first_unit = 2
        if cfg.noise:
            names[f"blocks.{b}.noise.proj"] = f"{block}.2.linear"
            first_unit = 3
        for r in range(3):
            unit = f"{block}.{first_unit + r}.block"
            for ours, theirs in (("snake1", "0"), ("conv", "1"), ("snake2", "2"), ("proj", "3")):
                names[f"blocks.{b}.residuals.{r}.{ours}"] = f"{unit}.{theirs}"
        j += 1
    names["out_snake"] = f"decoder.model.{j}"
    names["out_conv"] = f"decoder.model.{j + 1}"
    return names


def read_checkpoint(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's checkpoint, on the host. Safetensors files
    win over pytorch_model.bin when a folder has both."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(shard), device="cpu"))
        return tensors
    binary = folder / BIN_FILE
    if binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:  # not plain tensors, or torn
            raise ConfigError(f"{binary}: cannot load as plain tensors: {e}") from None
        if not isinstance(state, dict):
            raise ConfigError(f"{binary}: expected a state dict, got {type(state).__name__}")
        return state
    raise ConfigError(f"{folder}: no {BIN_FILE} and no *.safetensors files")


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """g * v / ||v||, the norm over every dim but 0, in float32."""
    g, v = g.to(torch.float32), v.to(torch.float32)
    if g.shape != (v.shape[0],) + (1,) * (v.dim() - 1):
        raise ValueError(f"weight norm g {tuple(g.shape)} is not per output slice of v {tuple(v.shape)}")
    norm = v.flatten(1).norm(dim=1).view_as(g)
    return v * (g / norm)


def _conv_weight(tensors: dict[str, torch.Tensor], base: str, used: set[str]) -> torch.Tensor | None:
    for g_name, v_name in WEIGHT_NORM_FORMS:
        g_key, v_key = f"{base}.{g_name}", f"{base}.{v_name}"
        if g_key in tensors and v_key in tensors:
            used.update((g_key, v_key))
            try:
                return fold_weight_norm(tensors[g_key], tensors[v_key])
            except ValueError as e:
                raise ConfigError(f"'{base}': {e}") from None
    plain = f"{base}.weight"
    if plain in tensors:
        used.add(plain)
        return tensors[plain]
    return None


def load_weights(decoder: SnacDecoder, folder: str | Path) -> None:
    """Fill `decoder` from the checkpoint in `folder`."""
    tensors = read_checkpoint(folder)
    where = package_modules(decoder.config)
    modules = dict(decoder.named_modules())
    used: set[str] = set()
    missing: list[str] = []
    for name, param in decoder.named_parameters():
        module_path, kind = name.rsplit(".", 1)
        base = where[module_path]
        if kind == "weight" and isinstance(modules[module_path], (nn.Conv1d, nn.ConvTranspose1d)):
            value = _conv_weight(tensors, base, used)
            source = f"{base}.weight"
        else:
            source = f"{base}.{kind}"
            value = tensors.get(source)
            if value is not None:
                used.add(source)
        if value is None:
            missing.append(source)
            continue
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(f"{folder}: tensor '{source}' has shape {tuple(value.shape)}, "
                              f"the config expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
    unexpected = sorted(k for k in tensors if k not in used and not IGNORED.fullmatch(k))
    if missing or unexpected:
        raise mismatch_error(folder, "snac", missing, unexpected)


def dummy_weights(decoder: SnacDecoder, seed: int = 0) -> None:
    """Seeded random weights at the scale of torch's default init (which is
    what `snac.SNAC(...)` starts from, and decodes to audio that is neither
    silent nor clipped): conv and linear weights and biases N(0, 1/(3 fan_in)),
    codebooks N(0, 1), unit snake alphas and norms. Drawn in
    float32 on the host per tensor, so every device and dtype gets the same
    values."""
    modules = dict(decoder.named_modules())
    for i, (name, param) in enumerate(decoder.named_parameters()):
        module_path, kind = name.rsplit(".", 1)
        module = modules[module_path]
        if kind == "alpha" or isinstance(module, nn.LayerNorm):
            # alpha near 0 would blow up snake's 1/alpha; a LayerNorm starts as identity
            with torch.no_grad():
                param.fill_(1.0 if kind in ("alpha", "weight") else 0.0)
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        # torch's fan-in: everything but dim 0 of the weight (for a transposed conv, its output
        # channels x kernel); its U(-1/sqrt(fan_in), 1/sqrt(fan_in)) has variance 1/(3 fan_in)
        fan_in = module.weight[0].numel()
        std = 1.0 if isinstance(module, nn.Embedding) else (3 * fan_in) ** -0.5
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            param.copy_(values)


def load_snac_decoder(folder: str | Path | None, *, load_format: str = "auto", device: Device = "cpu",
                      dtype: torch.dtype = torch.float32, config: SnacConfig | None = None,
                      seed: int = 0) -> SnacDecoder:
    """The decoder of the snac folder `folder`, on `device` in `dtype`, in eval mode.

    `load_format="dummy"`: random weights (seeded by `seed`) of the folder's
    config, or of `config` (default SNAC_24KHZ) when `folder` is None."""
    check_load_format(load_format)
    if folder is not None:
        cfg = read_config(folder)
        if config is not None and config != cfg:
            raise ConfigError(f"{folder}: its config.json differs from the config passed in")
    elif load_format == "dummy":
        cfg = config or SNAC_24KHZ
    else:
        raise ConfigError("a snac decoder without a folder needs load_format='dummy'")
    decoder = SnacDecoder(cfg, device=device, dtype=dtype)
    if load_format == "dummy":
        dummy_weights(decoder, seed)
    else:
        assert folder is not None
        load_weights(decoder, folder)
    return decoder.eval().requires_grad_(False)
