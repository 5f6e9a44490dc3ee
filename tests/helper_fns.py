"""Functions the helper-process tests run in a spawned process (importable by
name, as spawning needs)."""

from __future__ import annotations

import torch


def add_in_place(x: torch.Tensor, value: float) -> float:
    """Writes into the caller's memory (shared, not copied), returns the new sum."""
    x.add_(value)
    return float(x.sum())


def negated(x: torch.Tensor) -> torch.Tensor:
    return -x


def fails(x: torch.Tensor) -> None:
    raise ValueError("bad media")
