"""`--kv-cache-dtype fp8` on the CPU reference: float8 pages hold each key
and value rounded to e4m3; they move (stores, gathers, copies, swaps) as
bytes; the reference attention over them computes exactly what it computes
over full-precision pages holding the same rounded values; XQA's dense page
tables are the layout's pages; and a served model stays close to the one
with full-precision pages."""

from __future__ import annotations

import pytest
import torch
from greedy_top5 import greedy_top5

from mstar.config import EngineConfig, parse_args
from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.paged_layout import build_layout, decode_bucket
from mstar.engine.memory.xqa_decode import dense_tables
from mstar.kernels.qkv_store import KVDest, qkv_norm_rope_store_reference
from mstar.kernels.rope_kv import put_rows, store_kv, take_rows
from mstar.models.base import KVSpec

FP8 = torch.float8_e4m3fn
SPEC = KVSpec(2, 2, 16)
PAGE = 4


def test_rows_move_as_float8_values():
    dst = torch.zeros(6, 3, dtype=FP8)
    src = torch.tensor([[0.3, -1.7, 500.0], [1e-4, 2.0, -448.0]])
    put_rows(dst, torch.tensor([4, 1]), src)
    assert torch.equal(dst[4].float(), src[0].to(FP8).float()) and torch.equal(dst[1].float(), src[1].to(FP8).float())
    assert dst[4, 2].float() == 448.0   # saturates, as torch's cast does
    assert not dst[[0, 2, 3, 5]].float().any()
    got = take_rows(dst, torch.tensor([[1, 4], [4, 4]]))
    assert got.dtype == FP8 and got.shape == (2, 2, 3)
    assert torch.equal(got[0, 1].float(), dst[4].float()) and torch.equal(got[1, 0].float(), dst[4].float())


def test_float8_pages_take_half_the_bytes_and_token_rows_keep_theirs():
    spec = KVSpec(2, 2, 16, token_rows=(("hidden", 8),))
    full = KVCache.bytes_per_page(spec, PAGE, torch.bfloat16)
    fp8 = KVCache.bytes_per_page(spec, PAGE, torch.bfloat16, FP8)
    assert full == (2 * 2 * 2 * 16 + 8) * PAGE * 2
    assert fp8 == (2 * 2 * 2 * 16) * PAGE + 8 * PAGE * 2
    cache = KVCache(spec, 5, PAGE, "cpu", torch.bfloat16, FP8)
    assert cache.k[0].dtype == FP8 and cache.rows["hidden"].dtype == torch.bfloat16
    assert cache.memory_bytes() == 5 * fp8


def test_stores_round_into_float8_pages():
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(SPEC, 6, PAGE, "cpu", torch.float32, FP8)
    k, v = torch.randn(3, 2, 16, generator=gen) * 3, torch.randn(3, 2, 16, generator=gen)
    slots = torch.tensor([0, 9, 23])
    store_kv(k, v, cache.k[1], cache.v[1], slots)
    flat_k, flat_v = cache.k[1].view(-1, 2, 16), cache.v[1].view(-1, 2, 16)
    assert (torch.equal(flat_k[slots].float(), k.to(FP8).float())
            and torch.equal(flat_v[slots].float(), v.to(FP8).float()))
    # the normed, rotated store of Qwen3-style layers too: its k rounded once more, to e4m3
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=gen)
    w, cos, sin = torch.ones(16), torch.ones(3, 16), torch.zeros(3, 16)
    full = KVDest(torch.zeros(24, 2, 16), torch.zeros(24, 2, 16), slots=slots)
    qkv_norm_rope_store_reference(qkv, 4, 2, w, w, cos, sin, 1e-6, full)
    qkv_norm_rope_store_reference(qkv, 4, 2, w, w, cos, sin, 1e-6, cache.dest(0, 3, 3, 2, 16, slots))
    assert torch.equal(cache.k[0].view(-1, 2, 16)[slots].float(), full.k[slots].to(FP8).float())
    assert torch.equal(cache.v[0].view(-1, 2, 16)[slots].float(), full.v[slots].to(FP8).float())


def test_reference_attention_over_float8_pages_is_over_their_values():
    """A mixed step (a prefill row, decode rows) over float8 pages equals the
    same step over float32 pages holding the same e4m3 values."""
    gen = torch.Generator().manual_seed(1)
    fp8 = KVCache(SPEC, 12, PAGE, "cpu", torch.float32, FP8)
    f32 = KVCache(SPEC, 12, PAGE, "cpu", torch.float32)
    for layer in range(SPEC.num_layers):
        for a, b in ((fp8.k[layer], f32.k[layer]), (fp8.v[layer], f32.v[layer])):
            a.copy_(torch.randn(a.shape, generator=gen).to(FP8))
            b.copy_(a.float())
    qs, ctx, tables = torch.tensor([0, 5, 6, 7]), torch.tensor([2, 9, 0]), [[3, 7], [1, 0, 11], [5]]
    plans = [TorchPagedAttention(c, qs, ctx, tables) for c in (fp8, f32)]
    for layer in range(SPEC.num_layers):
        q = torch.randn(7, 4, 16, generator=gen)
        k, v = (torch.randn(7, 2, 16, generator=gen).to(FP8).float() for _ in range(2))  # e4m3 values already
        got, want = (p.forward(layer, q, k, v, 0.3) for p in plans)
        assert torch.equal(got, want)


def test_float8_pages_copy_and_swap_whole():
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(SPEC, 6, PAGE, "cpu", torch.float32, FP8)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(FP8))
    before = [t.float().clone() for t in cache.k + cache.v]
    cache.copy_pages([1, 2], [4, 5])
    assert all(torch.equal(t[[4, 5]].float(), b[[1, 2]]) for t, b in zip(cache.k + cache.v, before))
    swapped = cache.swap_out([0, 4])
    saved = [t[[0, 4]].float().clone() for t in cache.k + cache.v]
    for t in cache.k + cache.v:
        t.zero_()
    cache.swap_in(swapped, [3, 1])
    assert all(torch.equal(t[[3, 1]].float(), s) for t, s in zip(cache.k + cache.v, saved))


def test_dense_tables_hold_each_rows_pages_and_length():
    layout = build_layout(torch.arange(4), torch.tensor([0, 16, 37]), [[7], [2, 9], [4, 1, 8, 6]], 16, 20)
    table, lens = dense_tables(layout, 16, 20)
    assert table.tolist() == [[7, 20, 20], [2, 9, 20], [4, 1, 8]] and lens.tolist() == [1, 17, 38]
    # a graph bucket: its padding rows one token on the scratch page, tables as wide as the bucket's
    bucket = decode_bucket(4, torch.tensor([5, 31]), torch.tensor([[3, 0], [6, 2]]), 16, 20)
    table, lens = dense_tables(bucket, 16, 20, width=5)
    assert table.tolist() == [[3, 20, 20, 20, 20], [6, 2, 20, 20, 20], [20] * 5, [20] * 5]
    assert lens.tolist() == [6, 32, 1, 1]
    with pytest.raises(ValueError, match="holds 1"):
        dense_tables(layout, 16, 20, width=1)


def test_the_flag():
    assert parse_args(["--kv-cache-dtype", "fp8"]).engine.kv_cache_dtype == "fp8"
    assert parse_args([]).engine.kv_cache_dtype == "auto"


def _served(kv_cache_dtype: str) -> tuple[list[int], list[dict[int, float]], torch.dtype]:
    """tiny-llama's greedy tokens for one prompt, each position's top-5 logprobs, and its pages' dtype."""
    return greedy_top5(EngineConfig(model="tiny-llama", kv_cache_dtype=kv_cache_dtype), [5, 9, 200, 7],
                       inspect=lambda eng: eng.workers[0].runners["llm"].kv.k[0].dtype)


def test_a_served_model_over_float8_pages_stays_close():
    full_tokens, full_top, full_dtype = _served("auto")
    fp8_tokens, fp8_top, fp8_dtype = _served("fp8")
    assert full_dtype == torch.float32 and fp8_dtype == FP8
    assert len(fp8_tokens) == len(full_tokens) == 12 and len(fp8_top) == 12
    # the first position: the prompt's keys and values rounded to e4m3, nothing else
    first = full_top[0]
    assert set(fp8_top[0]) == set(first)
    assert max(abs(fp8_top[0][t] - lp) for t, lp in first.items()) < 0.1
    assert fp8_tokens[0] == full_tokens[0]


def test_an_unknown_kv_cache_dtype_is_refused():
    from mstar.engine.execution.components import kv_cache_dtype
    from mstar.errors import ConfigError

    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), torch.device("cpu"), torch.float32) == FP8
    assert kv_cache_dtype(EngineConfig(), torch.device("cpu"), torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="auto or fp8"):
        kv_cache_dtype(EngineConfig(kv_cache_dtype="bf16"), torch.device("cpu"), torch.float32)
