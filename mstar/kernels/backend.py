"""Which implementation runs a fused op: tensors in, Triton or the torch
reference out.

Triton kernels serve CUDA tensors when triton imports; CPU tensors, and
machines without triton, take the torch reference. Tests run the Triton path
on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set before
the kernels are decorated).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: every op falls back to torch
    triton = None
    tl = None

HAVE_TRITON = triton is not None


def jit(fn: Callable[..., Any] | None = None, *, per_row: tuple[str, ...] = (),
        any_value: tuple[str, ...] = ()) -> Any:
    """`triton.jit` where triton imports; otherwise the bare function, which
    is never launched because `use_triton` is then always False.

    `per_row`: pointer parameters not specialised on their 16-byte
    alignment. Triton compiles a kernel apart for each alignment of each
    pointer; a per-row column (a row's seed, top-p, ...) in a stack of them,
    or a slice of rows starting anywhere in a batch, is aligned or not by the
    row count or offset, so a burst of a new size would wait seconds for a
    compile that buys a scalar load (or a wider load) little.
    `any_value`: integer parameters likewise not specialised (Triton
    compiles 1 and multiples of 16 apart) where their value varies by call."""
    def wrap(f: Callable[..., Any]) -> Any:
        unknown = set(per_row) | set(any_value)
        unknown -= set(inspect.signature(f).parameters)
        if unknown:  # triton would ignore them, and compile per alignment or value again
            raise TypeError(f"{f.__name__} has no parameters {sorted(unknown)}")
        if not HAVE_TRITON:
            return f
        options: dict[str, list[str]] = {}
        if per_row:
            options["do_not_specialize_on_alignment"] = list(per_row)
        if any_value:
            options["do_not_specialize"] = list(any_value)
        return triton.jit(f, **options)
    return wrap(fn) if fn is not None else wrap


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


@functools.cache
def _dependent_launch(device: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # a CUDA build's
    # CUDA graphs capture such launches from driver 12.3 on
    return ("launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device)[0] >= 9
            and (driver is None or driver() >= 12030))


def dependent_launch(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device may launch as a programmatic dependent
    of the one before it (Hopper and later, and a triton that can ask for
    it): its programs then start while that kernel's last ones run, and wait
    for its memory where the kernel says (`tl.extra.cuda.gdc_wait`)."""
    return use_triton(x) and os.environ.get("TRITON_INTERPRET") != "1" and _dependent_launch(
        torch.cuda.current_device() if x.device.index is None else x.device.index)


def cdiv(a: int, b: int) -> int:
    """How many blocks of `b` cover `a` (a launch grid's size)."""
    return -(-a // b)


def block_size(n: int) -> int:
    """The power of two a kernel tiles `n` elements with (tl.arange needs one)."""
    return 1 << max(n - 1, 0).bit_length()


def num_warps(elements: int) -> int:
    """Warps for a program touching `elements` values: about 8 per thread.
    Fixed from shapes rather than autotuned, so launches stay deterministic
    and graph-capturable."""
    return min(block_size(max(elements // 256, 1)), 16)


def row_tiles(rows: int, width: int, tile: int = 1024, min_block: int = 16) -> tuple[int, int, tuple[int, int]]:
    """How a kernel over `rows` rows of `width` values tiles them: (rows a
    program covers, columns it covers, grid). A program covers `tile` values,
    its block of columns no wider than the rows, so short rows (a deep
    vocoder block's few dozen samples) do not leave most lanes masked."""
    block = min(tile, max(min_block, block_size(width)))
    per = tile // block
    return per, block, (cdiv(rows, per), cdiv(width, block))


__all__ = ["HAVE_TRITON", "block_size", "cdiv", "dependent_launch", "jit", "num_warps", "row_tiles", "tl", "triton",
           "use_triton"]
