"""TorchPagedAttention against a naive per-row attention on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.memory.kv_cache import KVCache
from mstar.models.base import KVSpec

PAGE = 4


def naive(q, keys, values, ctx, scale, causal=True):
    """One row: q [n, Hq, D] at positions ctx..ctx+n-1, keys/values [ctx+n, Hkv, D];
    non-causal, every query sees every key."""
    hq, hkv = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(hq // hkv, dim=1).double()
    values = values.repeat_interleave(hq // hkv, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    n, total = q.shape[0], keys.shape[0]
    allowed = torch.arange(total)[None, :] <= (ctx + torch.arange(n))[:, None]
    if causal:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def random_pages(gen, num_pages, counts):
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, start = [], 0
    for c in counts:
        tables.append(perm[start:start + c])
        start += c
    return tables


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (8, 1)])
def test_mixed_batch_matches_naive(hq, hkv, causal, device):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    d, layers = 8, 2
    cache = KVCache(KVSpec(layers, hkv, d), num_pages=64, page_size=PAGE, device=device, dtype=torch.float32)
    # rows: fresh prefill, prefill on cached context, decodes, an empty-ish decode at position 0
    ctx = [0, 6, 9, 0, 13]
    new = [7, 5, 1, 1, 1]
    tables = random_pages(gen, 64, [math.ceil((c + n) / PAGE) + 1 for c, n in zip(ctx, new)])
    # the cached history of each row, written straight into its pages
    hist_k = [torch.randn(layers, c, hkv, d, generator=gen) for c in ctx]
    hist_v = [torch.randn(layers, c, hkv, d, generator=gen) for c in ctx]
    for row, c in enumerate(ctx):
        for p in range(c):
            page, off = tables[row][p // PAGE], p % PAGE
            for layer in range(layers):
                cache.k[layer][page, off] = hist_k[row][layer, p]
                cache.v[layer][page, off] = hist_v[row][layer, p]
    qs = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    attn = TorchPagedAttention(cache, qs, torch.tensor(ctx), tables, causal=causal)
    t = int(qs[-1])
    scale = d ** -0.5
    for layer in range(layers):
        q = torch.randn(t, hq, d, generator=gen)
        k = torch.randn(t, hkv, d, generator=gen)
        v = torch.randn(t, hkv, d, generator=gen)
        out = attn.forward(layer, q.to(device), k.to(device), v.to(device), scale).cpu()
        assert out.shape == (t, hq, d) and out.dtype == q.dtype
        for row in range(len(ctx)):
            sl = slice(int(qs[row]), int(qs[row + 1]))
            keys = torch.cat([hist_k[row][layer], k[sl]])
            values = torch.cat([hist_v[row][layer], v[sl]])
            ref = naive(q[sl], keys, values, ctx[row], scale, causal)
            torch.testing.assert_close(out[sl].double(), ref, atol=1e-5, rtol=1e-5)


def test_writes_new_tokens_into_their_slots():
    cache = KVCache(KVSpec(1, 2, 4), num_pages=8, page_size=PAGE, device="cpu", dtype=torch.float32)
    tables = [[5, 2], [7]]
    attn = TorchPagedAttention(cache, torch.tensor([0, 6, 7]), torch.tensor([0, 2]), tables)
    k = torch.arange(7, dtype=torch.float32)[:, None, None].expand(7, 2, 4).clone()
    attn.forward(0, torch.zeros(7, 2, 4), k, k + 100, 1.0)
    assert cache.k[0][5, :, 0, 0].tolist() == [0, 1, 2, 3]
    assert cache.k[0][2, :2, 0, 0].tolist() == [4, 5]
    assert cache.k[0][7, 2, 0, 0].item() == 6  # row 1: position 2 in its first page
    assert cache.v[0][7, 2, 0, 0].item() == 106


def test_bf16_cache_returns_query_dtype():
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(KVSpec(1, 2, 8), num_pages=8, page_size=PAGE, device="cpu", dtype=torch.bfloat16)
    attn = TorchPagedAttention(cache, torch.tensor([0, 3]), torch.tensor([0]), [[3]])
    q = torch.randn(3, 4, 8, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 8, generator=gen, dtype=torch.bfloat16)
    out = attn.forward(0, q, k, k, 8 ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = naive(q.float(), k.float(), k.float(), 0, 8 ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_short_block_table_is_refused():
    cache = KVCache(KVSpec(1, 1, 4), num_pages=4, page_size=PAGE, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="needs 2 pages"):
        TorchPagedAttention(cache, torch.tensor([0, 5]), torch.tensor([0]), [[1]])
    with pytest.raises(ValueError, match="outside"):
        TorchPagedAttention(cache, torch.tensor([0, 2]), torch.tensor([0]), [[9]])


def test_pages_for_memory():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)
    per_page = KVCache.bytes_per_page(spec, 16, torch.float32)
    assert per_page == 2 * 2 * 16 * 2 * 16 * 4
    assert KVCache.pages_for_memory(spec, 16, torch.float32, 10 * per_page + 1) == 10
