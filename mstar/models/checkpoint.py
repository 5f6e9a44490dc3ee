"""What loaders share about checkpoint folders: reading their JSON files, and
the error that lists the tensors a checkpoint lacks and the ones it has that
the model does not. Importable without torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError

_SHOWN = 8


def read_json(file: Path, *, required: bool = True) -> Any:
    """The parsed JSON of `file`; None when it is absent and not required.
    A missing required file or unreadable JSON is a `ConfigError`."""
    if not file.is_file():
        if required:
            raise ConfigError(f"{file.parent}: no {file.name}")
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: cannot read: {e}") from None


def mismatch_error(folder: str | Path, model: str, missing: Sequence[str],
                   unexpected: Sequence[str]) -> ConfigError:
    """A `ConfigError` naming up to eight missing and unexpected tensors."""
    parts = []
    for label, names in (("missing", sorted(missing)), ("unexpected", sorted(unexpected))):
        if names:
            more = " ..." if len(names) > _SHOWN else ""
            parts.append(f"{label} {len(names)} tensor(s): {', '.join(names[:_SHOWN])}{more}")
    return ConfigError(f"{folder}: checkpoint does not match the {model} config: {'; '.join(parts)}")
