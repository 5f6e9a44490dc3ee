"""What loaders share about checkpoints: the error that lists the tensors a
checkpoint lacks and the ones it has that the model does not."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mstar.errors import ConfigError

_SHOWN = 8


def mismatch_error(folder: str | Path, model: str, missing: Sequence[str],
                   unexpected: Sequence[str]) -> ConfigError:
    """A `ConfigError` naming up to eight missing and unexpected tensors."""
    parts = []
    for label, names in (("missing", sorted(missing)), ("unexpected", sorted(unexpected))):
        if names:
            more = " ..." if len(names) > _SHOWN else ""
            parts.append(f"{label} {len(names)} tensor(s): {', '.join(names[:_SHOWN])}{more}")
    return ConfigError(f"{folder}: checkpoint does not match the {model} config: {'; '.join(parts)}")
