"""Block tables for attention tests: each row's pages drawn from a random
permutation of the pool, so they are never contiguous or in order; and
caches of random contents to attend over."""

from __future__ import annotations

import math

import torch

from mstar.engine.memory.kv_cache import KVCache
from mstar.models.base import KVSpec


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


def random_caches(seed: int, layers: int, kv_heads: int, head_dim: int, num_pages: int, page: int,
                  device: str = "cuda", kv_dtype: torch.dtype = torch.bfloat16) -> tuple[KVCache, KVCache]:
    """Two bf16-model KV caches (pages in `kv_dtype`) with the same random
    contents: one for the backend under test, one for the reference."""
    gen = torch.Generator().manual_seed(seed)
    spec = KVSpec(layers, kv_heads, head_dim)
    fi = KVCache(spec, num_pages, page, device, torch.bfloat16, kv_dtype)
    ref = KVCache(spec, num_pages, page, device, torch.bfloat16, kv_dtype)
    for layer in range(layers):
        for t in (fi.k[layer], fi.v[layer]):
            t.copy_(torch.randn(t.shape, generator=gen).to(kv_dtype))
        ref.k[layer].copy_(fi.k[layer])
        ref.v[layer].copy_(fi.v[layer])
    return fi, ref
