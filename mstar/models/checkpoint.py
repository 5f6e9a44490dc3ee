"""What loaders share about checkpoint folders: the load formats, reading
their JSON files (and the EOS ids and sampling defaults of a generation
config), and the error that lists the tensors a checkpoint lacks and the
ones it has that the model does not. Importable without torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError, RequestError
from mstar.types import SamplingParams

_SHOWN = 8
LOAD_FORMATS = ("auto", "dummy")   # a folder's weights, or seeded random ones of its shape


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load format '{load_format}' is not one of {', '.join(LOAD_FORMATS)}")


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


def generation_eos(folder: Path) -> tuple[int, ...]:
    """The `eos_token_id` of the folder's generation_config.json (one id or
    a list; () when the file or the key is absent)."""
    gen = read_json(folder / "generation_config.json", required=False)
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    return (eos,) if isinstance(eos, int) else tuple(eos or ())


# generation_config.json's fields a server takes as its default sampling (vLLM's set), by `SamplingParams` name
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTEGER_FIELDS = ("top_k", "max_tokens")


def generation_defaults(folder: Path) -> dict[str, float | int]:
    """The sampling the folder's generation_config.json sets, by
    `SamplingParams` field ({} when the file is absent): what its authors
    ship as the model's defaults, for the fields a request leaves out.
    `max_new_tokens` is `max_tokens`. A value out of `SamplingParams`'
    ranges is a `ConfigError` naming the file and the field."""
    file = folder / "generation_config.json"
    gen = read_json(file, required=False)
    if gen is None:
        return {}
    if not isinstance(gen, dict):
        raise ConfigError(f"{file}: not a JSON object")
    out: dict[str, float | int] = {}
    for key, name in _SAMPLING_FIELDS.items():
        value = gen.get(key)
        if value is None:
            continue
        integer = name in _INTEGER_FIELDS
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ConfigError(f"{file}: '{key}' must be {'an integer' if integer else 'a number'}, not {value!r}")
        out[name] = value if integer else float(value)
    try:
        SamplingParams(**out).validate()
    except RequestError as e:
        key = next((k for k, n in _SAMPLING_FIELDS.items() if n == e.field), e.field)
        raise ConfigError(f"{file}: '{key}' {e.message}") from None
    return out


def mismatch_error(folder: str | Path, model: str, missing: Sequence[str],
                   unexpected: Sequence[str]) -> ConfigError:
    """A `ConfigError` naming up to eight missing and unexpected tensors."""
    parts = []
    for label, names in (("missing", sorted(missing)), ("unexpected", sorted(unexpected))):
        if names:
            more = " ..." if len(names) > _SHOWN else ""
            parts.append(f"{label} {len(names)} tensor(s): {', '.join(names[:_SHOWN])}{more}")
    return ConfigError(f"{folder}: checkpoint does not match the {model} config: {'; '.join(parts)}")
