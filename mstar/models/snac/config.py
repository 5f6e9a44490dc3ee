"""SnacConfig: the snac package's config.json dict in, the frozen codec
numbers the decoder and its loader need out.

The keys are the keyword arguments of `snac.SNAC(...)`, which is how the
package itself reads its config.json. The encoder numbers are kept because
they fix the latent width (`latent_dim` defaults to
`encoder_dim * 2**len(encoder_rates)`), even though only the decoder is built.
Also holds SNAC_24KHZ, the codec of Orpheus.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError
from mstar.models.checkpoint import read_json

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
# keys some exported folders carry besides the SNAC(...) arguments
BOOKKEEPING_KEYS = frozenset({"model_type", "architectures", "torch_dtype", "transformers_version"})


@dataclass(frozen=True)
class SnacConfig:
    sampling_rate: int
    encoder_dim: int
    encoder_rates: tuple[int, ...]
    decoder_dim: int
    decoder_rates: tuple[int, ...]
    attn_window_size: int | None
    codebook_size: int
    codebook_dim: int
    vq_strides: tuple[int, ...]
    noise: bool = True
    depthwise: bool = True
    latent_dim: int | None = None   # None: encoder_dim * 2**len(encoder_rates), as the package derives it

    def __post_init__(self) -> None:
        for name in ("sampling_rate", "encoder_dim", "decoder_dim", "codebook_size", "codebook_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"snac config: {name} must be positive, got {getattr(self, name)}")
        for name in ("encoder_rates", "decoder_rates", "vq_strides"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values):
                raise ConfigError(f"snac config: {name} must be a non-empty list of positive ints, got {list(values)}")
        coarse = self.vq_strides[0]
        if any(coarse % s for s in self.vq_strides):
            # every level's code rate must divide the coarsest one, or a window of
            # whole coarse frames would not be whole frames of every level
            raise ConfigError(f"snac config: vq_strides {list(self.vq_strides)} must each divide the first")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ConfigError(f"snac config: decoder_dim {self.decoder_dim} must halve "
                              f"{len(self.decoder_rates)} times (once per decoder rate)")
        if self.attn_window_size is not None and (self.attn_window_size <= 0 or self.decoder_dim % 64):
            raise ConfigError(f"snac config: attention needs a positive attn_window_size and decoder_dim a "
                              f"multiple of 64 (its head size), got {self.attn_window_size} and {self.decoder_dim}")

    # -- derived numbers
    @property
    def latent(self) -> int:
        """Channels of the quantized latent the decoder starts from."""
        return self.latent_dim if self.latent_dim is not None else self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Audio samples per latent frame (per code of the finest level when its stride is 1)."""
        return math.prod(self.decoder_rates)

    @property
    def num_levels(self) -> int:
        return len(self.vq_strides)

    @property
    def samples_per_coarse_frame(self) -> int:
        """Audio samples one code of the coarsest level spans (24 kHz: 4 * 512 = 2048)."""
        return self.vq_strides[0] * self.hop_length

    def level_lengths(self, coarse_frames: int) -> tuple[int, ...]:
        """Codes per level for a window of `coarse_frames` coarse codes (24 kHz: T, 2T, 4T)."""
        return tuple(coarse_frames * (self.vq_strides[0] // s) for s in self.vq_strides)

    # -- the package's config.json
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SnacConfig:
        """From a parsed config.json; missing keys take `snac.SNAC`'s defaults
        where the package has one that does not depend on the sampling rate."""
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__} - BOOKKEEPING_KEYS)
        if unknown:
            log.warning("snac config: ignoring unknown keys %s", ", ".join(unknown))
        try:
            window = d.get("attn_window_size", 32)  # the package's default; 24 kHz sets null
            latent = d.get("latent_dim")
            return cls(
                sampling_rate=int(d["sampling_rate"]),
                encoder_dim=int(d["encoder_dim"]),
                encoder_rates=tuple(int(r) for r in d["encoder_rates"]),
                decoder_dim=int(d["decoder_dim"]),
                decoder_rates=tuple(int(r) for r in d["decoder_rates"]),
                attn_window_size=None if window is None else int(window),
                codebook_size=int(d.get("codebook_size", 4096)),
                codebook_dim=int(d.get("codebook_dim", 8)),
                vq_strides=tuple(int(s) for s in d["vq_strides"]),
                noise=bool(d.get("noise", True)),
                depthwise=bool(d.get("depthwise", True)),
                latent_dim=None if latent is None else int(latent),
            )
        except KeyError as e:
            raise ConfigError(f"snac config: missing key {e}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"snac config: bad value: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict (`snac.SNAC(**config.to_dict())` builds the same codec)."""
        d = asdict(self)
        for name in ("encoder_rates", "decoder_rates", "vq_strides"):
            d[name] = list(d[name])
        if d["latent_dim"] is None:
            del d["latent_dim"]
        return d


def read_config(folder: str | Path) -> SnacConfig:
    """The SnacConfig of a local snac folder (its config.json)."""
    file = Path(folder) / CONFIG_FILE
    data = read_json(file)
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return SnacConfig.from_dict(data)


# hubertsiuzdak/snac_24khz: the codec Orpheus speaks through (19.84 M parameters with its encoder)
SNAC_24KHZ = SnacConfig(
    sampling_rate=24_000,
    encoder_dim=48,
    encoder_rates=(2, 4, 8, 8),
    decoder_dim=1024,
    decoder_rates=(8, 8, 4, 2),
    attn_window_size=None,
    codebook_size=4096,
    codebook_dim=8,
    vq_strides=(4, 2, 1),
    noise=True,
    depthwise=True,
)
