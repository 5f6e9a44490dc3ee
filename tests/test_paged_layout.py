"""PagedLayout (FlashInfer's page lists, built on the host) against a per-row
spelling-out of the format and against TorchPagedAttention's slot mapping."""

from __future__ import annotations

import math

import pytest
import torch
from paged_tables import scattered_tables

from mstar.engine.memory.attention import TorchPagedAttention
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.paged_layout import build_layout, decode_bucket, host_lens
from mstar.models.base import KVSpec

PAGE = 4
NUM_PAGES = 64


def random_tables(gen: torch.Generator, ctx: list[int], new: list[int], spare: int = 1) -> list[list[int]]:
    return scattered_tables(gen, ctx, new, page=PAGE, num_pages=NUM_PAGES, spare=spare)


def per_row(ctx, new, tables):
    """The format spelled out one row at a time."""
    indptr, indices, last = [0], [], []
    for c, n, pages in zip(ctx, new, tables):
        seq = c + n
        used = math.ceil(seq / PAGE)
        indices += pages[:used]
        indptr.append(indptr[-1] + used)
        last.append(seq - (used - 1) * PAGE if used else 0)
    return indptr, indices, last


@pytest.mark.parametrize("as_tensor", [False, True])
def test_mixed_rows_match_the_format_and_the_reference_slots(as_tensor):
    gen = torch.Generator().manual_seed(0)
    ctx = [0, 6, 9, 0, 13, 4, 7]
    new = [7, 5, 1, 1, 1, 0, 4]   # a row with no new tokens still lists its pages
    tables = random_tables(gen, ctx, new)
    qs = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    bt = tables
    if as_tensor:  # padded like a scheduler's table, with junk past each row's pages
        width = max(map(len, tables))
        bt = torch.tensor([r + [-1] * (width - len(r)) for r in tables])
    layout = build_layout(qs, torch.tensor(ctx), bt, PAGE, NUM_PAGES)
    indptr, indices, last = per_row(ctx, new, tables)
    assert layout.kv_indptr.tolist() == indptr
    assert layout.kv_indices.tolist() == indices
    assert layout.kv_last_page_len.tolist() == last
    assert layout.qo_indptr.tolist() == qs.tolist()
    assert {t.dtype for t in (layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len)} \
        == {torch.int32}
    cache = KVCache(KVSpec(1, 1, 2), NUM_PAGES, PAGE, "cpu", torch.float32)
    ref = TorchPagedAttention(cache, qs, torch.tensor(ctx), tables)
    assert torch.equal(layout.slot_mapping, ref.slot_mapping)
    assert layout.num_tokens == sum(new) and layout.num_rows == len(ctx) and not layout.is_decode


def test_query_start_need_not_start_at_zero():
    tables = [[3, 4], [9]]
    layout = build_layout(torch.tensor([5, 8, 9]), torch.tensor([2, 0]), tables, PAGE, NUM_PAGES)
    assert layout.qo_indptr.tolist() == [0, 3, 4]
    assert layout.slot_mapping.tolist() == [3 * PAGE + 2, 3 * PAGE + 3, 4 * PAGE, 9 * PAGE]


def test_decode_rows_fill_the_last_page_then_open_the_next():
    ctx = [0, PAGE - 1, PAGE, 2 * PAGE + 1]
    tables = [[10], [11], [12, 13], [14, 15, 16]]
    layout = build_layout(torch.arange(5), torch.tensor(ctx), tables, PAGE, NUM_PAGES)
    assert layout.is_decode
    assert layout.kv_last_page_len.tolist() == [1, PAGE, 1, 2]
    assert layout.kv_indices.tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert layout.slot_mapping.tolist() == [10 * PAGE, 11 * PAGE + PAGE - 1, 13 * PAGE, 16 * PAGE + 1]


def test_decode_bucket_pads_onto_the_scratch_page():
    scratch = NUM_PAGES
    bt = torch.tensor([[5, 6, 0], [7, 0, 0]])
    layout = decode_bucket(4, torch.tensor([PAGE + 1, 0]), bt, PAGE, scratch)
    assert layout.num_rows == 4 and layout.is_decode
    assert layout.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert layout.kv_indices.tolist() == [5, 6, 7, scratch, scratch]
    assert layout.kv_last_page_len.tolist() == [2, 1, 1, 1]
    assert layout.slot_mapping.tolist() == [6 * PAGE + 1, 7 * PAGE, scratch * PAGE, scratch * PAGE]
    empty = decode_bucket(2, torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long), PAGE, scratch)
    assert empty.kv_indices.tolist() == [scratch, scratch] and empty.slot_mapping.tolist() == [scratch * PAGE] * 2


def test_seq_lens_are_what_flashinfer_derives_and_iterate_as_host_ints():
    """`seq_lens` equal FlashInfer's `get_seq_lens` of the page lists (what its decode plan computes when not
    given them); handed over through `host_lens`, its Python `max()` of them sees ints, `.cpu()` is the same
    object, and torch ops on them give plain tensors of the same values."""
    gen = torch.Generator().manual_seed(1)
    ctx, new = [0, 3, 4, 9, 17], [1, 1, 1, 1, 1]
    layout = build_layout(torch.arange(6), torch.tensor(ctx), random_tables(gen, ctx, new), PAGE, NUM_PAGES)
    derived = torch.clamp(layout.kv_indptr[1:] - layout.kv_indptr[:-1] - 1, min=0) * PAGE + layout.kv_last_page_len
    assert layout.seq_lens.dtype == torch.int32 and layout.seq_lens.tolist() == derived.tolist() == [1, 4, 5, 10, 18]
    lens = host_lens(layout.seq_lens)
    assert lens.cpu() is lens and max(lens).item() == 18 and [int(x) for x in lens] == [1, 4, 5, 10, 18]
    assert type(lens + 0) is torch.Tensor and torch.equal(lens + 0, layout.seq_lens)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="row 1 needs 2 pages"):
        build_layout(torch.tensor([0, 1, 2]), torch.tensor([0, PAGE]), [[1], [2]], PAGE, NUM_PAGES)
    with pytest.raises(ValueError, match="outside"):
        build_layout(torch.tensor([0, 1]), torch.tensor([0]), [[NUM_PAGES + 1]], PAGE, NUM_PAGES)
    with pytest.raises(ValueError, match="do not fit"):
        decode_bucket(1, torch.tensor([0, 0]), torch.zeros(2, 1, dtype=torch.long), PAGE, NUM_PAGES)
    with pytest.raises(ValueError, match="disagree"):
        build_layout(torch.tensor([0, 1]), torch.tensor([0, 0]), [[1], [2]], PAGE, NUM_PAGES)


@pytest.mark.parametrize("seed", range(4))
def test_decode_tables_as_arrays_lay_out_as_the_general_path_does(seed):
    """Decode rows over [B, P] tables (and `decode_bucket`'s padding) take a path of their own: the same
    layout as the general one gives the same tables as lists, padding rows spelled out."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = 1 + seed * 5, 2 + seed
    ctx = torch.randint(0, width * PAGE, (rows,), generator=gen)
    bt = torch.randint(0, NUM_PAGES + 1, (rows, width), generator=gen)
    fields = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "slot_mapping", "seq_lens")

    def same(a, b):
        assert a.max_query_len == b.max_query_len
        for f in fields:
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and x.tolist() == y.tolist(), f

    same(build_layout(torch.arange(rows + 1), ctx, bt, PAGE, NUM_PAGES),
         build_layout(torch.arange(rows + 1), ctx, bt.tolist(), PAGE, NUM_PAGES))
    pad = seed
    same(decode_bucket(rows + pad, ctx, bt, PAGE, NUM_PAGES),
         build_layout(torch.arange(rows + pad + 1), ctx.tolist() + [0] * pad, bt.tolist() + [[NUM_PAGES]] * pad,
                      PAGE, NUM_PAGES))
    with pytest.raises(ValueError, match="outside"):
        build_layout(torch.arange(2), torch.tensor([0]), torch.tensor([[NUM_PAGES + 1]]), PAGE, NUM_PAGES)
    with pytest.raises(ValueError, match="row 0 needs 2 pages for 5 tokens, its block table has 1"):
        decode_bucket(2, torch.tensor([PAGE]), torch.tensor([[1]]), PAGE, NUM_PAGES)
    with pytest.raises(ValueError, match="non-negative"):
        decode_bucket(2, torch.tensor([-1]), torch.tensor([[1]]), PAGE, NUM_PAGES)
    # a table of no pages: its row reads the scratch page, as the padded table gave it
    same(decode_bucket(2, torch.tensor([1]), torch.zeros(1, 0, dtype=torch.long), PAGE, NUM_PAGES),
         build_layout(torch.arange(3), [1, 0], [[NUM_PAGES], [NUM_PAGES]], PAGE, NUM_PAGES))
