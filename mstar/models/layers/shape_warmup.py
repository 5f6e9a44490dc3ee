"""Every row count an eager projection can run at, run once at startup: a
module's `Linear`s and `VocabHead`s in, zero inputs of each count through
one of each distinct projection, nothing kept.

An eager step's projections run at `padded_rows` of their rows, a few dozen
sizes. cuBLAS picks a kernel per size, and the first launch of a kernel the
process has not run costs milliseconds of its own (on an H100, ~3-5 ms a
GEMM against ~0.1-0.5 warm, whether CUDA loads modules lazily or not:
`scripts/probe_first_gemm.py`). A prefill step whose token count reaches a
size no step had reached paid that for each of a layer's projections while
every request in it waited: a server's first burst of 64 speech prompts took
a 64-row prefill step twice as long as the same burst later. Run here, that
cost is startup's.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.models.layers.linear import SMALL_ROWS, Linear, VocabHead, padded_rows


def row_counts(max_rows: int) -> list[int]:
    """The row counts eager projections of 2 to `max_rows` rows run at (one
    row takes the few-row kernel, warmed by its own compile)."""
    counts = list(range(2, min(SMALL_ROWS, max_rows) + 1))
    n = SMALL_ROWS + 1
    while n <= max_rows:
        counts.append(padded_rows(n))
        n = counts[-1] + 1
    return counts


def warm_projections(module: nn.Module, dtype: torch.dtype, max_rows: int, max_head_rows: int) -> int:
    """Run each distinct projection of `module` (by weight shape, dtype,
    bias and head window) at every count of `row_counts`: up to `max_rows`
    (a step's tokens) for a layer's, `max_head_rows` (a step's rows: a head
    reads the last position of each) for a head's. Inputs are zeros of
    `dtype`. Only on CUDA; returns how many calls ran."""
    seen: dict[tuple, nn.Module] = {}
    for part in module.modules():
        if isinstance(part, (Linear, VocabHead)):
            window = part.window if isinstance(part, VocabHead) else None
            bias = getattr(part, "bias", None) is not None
            key = (type(part), tuple(part.weight.shape), part.weight.dtype, bias, window)
            seen.setdefault(key, part)
    calls = 0
    for part in seen.values():
        if not _on_cuda(part.weight):
            continue
        top = max_head_rows if isinstance(part, VocabHead) else max_rows
        for rows in row_counts(top):
            part(torch.zeros(rows, part.in_features, device=part.weight.device, dtype=dtype))
            calls += 1
    return calls


def _on_cuda(weight: torch.Tensor) -> bool:
    return weight.device.type == "cuda"
