"""The devices a config names in, a `ConfigError` out when this machine
cannot run them: checked before the model loads, so a wrong `--gpus` fails
at once with one line instead of in a worker thread."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.errors import ConfigError


def check_devices(devices: Sequence[str]) -> None:
    """Raise `ConfigError` for a CUDA device without CUDA or beyond the
    devices this machine has."""
    for name in devices:
        device = torch.device(name)
        if device.type == "cpu":
            continue
        if device.type != "cuda":
            raise ConfigError(f"--gpus: device '{name}' is neither cpu nor CUDA")
        if not torch.cuda.is_available():
            raise ConfigError(f"--gpus: {name} asked for, but CUDA is not available here; use --gpus cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--gpus: there is no {name}: this machine has {count} CUDA device"
                              f"{'' if count == 1 else 's'} (0..{count - 1})")
