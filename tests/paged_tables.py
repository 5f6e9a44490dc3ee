"""Block tables for attention tests: each row's pages drawn from a random
permutation of the pool, so they are never contiguous or in order."""

from __future__ import annotations

import math

import torch


def scattered_tables(gen: torch.Generator, ctx: list[int], new: list[int], *, page: int, num_pages: int,
                     spare: int) -> list[list[int]]:
    """Per row, the pages for its `ctx + new` tokens and `spare` more."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    out, start = [], 0
    for c, n in zip(ctx, new):
        count = math.ceil((c + n) / page) + spare
        out.append(perm[start:start + count])
        start += count
    assert start <= num_pages, "the pool is too small for these rows"
    return out
