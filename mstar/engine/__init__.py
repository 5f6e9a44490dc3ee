"""The runtime behind `mstar.engine.engine.Engine`; at package level only
what a command line needs before torch loads: the built-in model names."""

from __future__ import annotations


def builtin_models() -> tuple[str, ...]:
    """The names `--model` serves without a folder."""
    from mstar.models.registry import BUILTINS

    return tuple(sorted(BUILTINS))
