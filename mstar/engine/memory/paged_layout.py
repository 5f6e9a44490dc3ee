"""PagedLayout: a step's rows (query_start, context_lens, block tables) in; the
page lists that paged-attention kernels read and the cache slots of the new
tokens out, as host torch tensors; built with numpy, vectorised over rows.

The format is FlashInfer's (CSR over pages): row i, with q_len_i new tokens
after ctx_i cached ones, holds seq_i = ctx_i + q_len_i tokens once this step's
tokens are appended, in n_i = ceil(seq_i / page_size) pages:

  kv_indptr [B+1]      0, n_0, n_0 + n_1, ...
  kv_indices [sum n]   each row's first n_i page ids, row after row
  kv_last_page_len [B] tokens in a row's last page: 1..page_size (0 for an empty row)
  qo_indptr [B+1]      where each row's queries start in the packed tokens
  slot_mapping [T]     page * page_size + offset of each new token
  seq_lens [B]         seq_i

`decode_bucket` pads n decode rows to a CUDA-graph batch size: padding rows
hold one token at position 0 of the scratch page.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class PagedLayout:
    qo_indptr: torch.Tensor         # [B + 1] int32
    kv_indptr: torch.Tensor         # [B + 1] int32
    kv_indices: torch.Tensor        # [kv_indptr[-1]] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor      # [T] int64
    max_query_len: int
    seq_lens: torch.Tensor          # [B] int32: tokens each row holds once this step's are in

    @property
    def num_rows(self) -> int:
        return self.kv_last_page_len.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def is_decode(self) -> bool:
        """Every row has exactly one new token."""
        return self.num_rows > 0 and self.max_query_len == 1 and self.num_tokens == self.num_rows


def _ints(x: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.int64).numpy()
    return np.asarray(x, dtype=np.int64)


def _flat_tables(block_tables: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
                 rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All page ids in one int64 vector, with each row's start and length in it."""
    if isinstance(block_tables, (torch.Tensor, np.ndarray)):
        bt = _ints(block_tables)
        if bt.ndim != 2 or bt.shape[0] != rows:
            raise ValueError(f"block_tables must be [B, P] with B = {rows}, got shape {tuple(bt.shape)}")
        width = bt.shape[1]
        return bt.reshape(-1), np.arange(rows, dtype=np.int64) * width, np.full(rows, width, dtype=np.int64)
    if len(block_tables) != rows:
        raise ValueError(f"block_tables must have one row per batch row ({rows}), got {len(block_tables)}")
    lengths = np.fromiter((len(r) for r in block_tables), dtype=np.int64, count=rows)
    # one pass over the scheduler's lists; everything after is vectorised
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum()))
    return flat, np.cumsum(lengths) - lengths, lengths


def build_layout(query_start: torch.Tensor | np.ndarray, context_lens: torch.Tensor | np.ndarray | Sequence[int],
                 block_tables: torch.Tensor | np.ndarray | Sequence[Sequence[int]], page_size: int,
                 max_page_id: int) -> PagedLayout:
    """The layout of one step; page ids a row uses must lie in [0, max_page_id]."""
    # numpy, not torch: these arrays are tens to thousands of ints, where a
    # torch op's dispatch costs more than its work, and this runs every step
    qs, ctx = _ints(query_start), _ints(context_lens)
    rows = qs.size - 1
    if rows < 0 or ctx.shape != (rows,):
        raise ValueError(f"query_start [B+1] and context_lens [B] disagree: {tuple(qs.shape)} vs {tuple(ctx.shape)}")
    q_lens = np.diff(qs)
    if (q_lens < 0).any() or (ctx < 0).any():
        raise ValueError("query_start must be non-decreasing and context_lens non-negative")
    if rows and isinstance(block_tables, (torch.Tensor, np.ndarray)) and (q_lens == 1).all():
        bt = _ints(block_tables)
        if bt.ndim != 2 or bt.shape[0] != rows:
            raise ValueError(f"block_tables must be [B, P] with B = {rows}, got shape {tuple(bt.shape)}")
        return _decode_layout(ctx, bt, page_size, max_page_id, 0, 0)
    flat, starts, lengths = _flat_tables(block_tables, rows)

    seq_lens = ctx + q_lens
    pages = (seq_lens + page_size - 1) // page_size
    short = np.flatnonzero(pages > lengths)
    if short.size:
        i = int(short[0])
        raise ValueError(f"row {i} needs {int(pages[i])} pages for {int(seq_lens[i])} tokens, "
                         f"its block table has {int(lengths[i])}")
    kv_indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(pages, out=kv_indptr[1:])
    # the j-th used page of row r sits at flat[starts[r] + j]
    page_row = np.repeat(np.arange(rows), pages)
    page_col = np.arange(kv_indptr[-1]) - kv_indptr[:-1][page_row]
    kv_indices = flat[starts[page_row] + page_col]
    if ((kv_indices < 0) | (kv_indices > max_page_id)).any():
        raise ValueError(f"block_tables hold page ids outside [0, {max_page_id}]")
    last_page_len = np.where(pages > 0, seq_lens - (pages - 1) * page_size, 0)

    num_tokens = int(qs[-1] - qs[0]) if rows else 0
    token_row = np.repeat(np.arange(rows), q_lens)
    pos = ctx[token_row] + np.arange(num_tokens) + qs[0] - qs[token_row]
    slots = flat[starts[token_row] + pos // page_size] * page_size + pos % page_size

    def i32(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int32))

    return PagedLayout(qo_indptr=i32(qs - qs[0]), kv_indptr=i32(kv_indptr), kv_indices=i32(kv_indices),
                       kv_last_page_len=i32(last_page_len), slot_mapping=torch.from_numpy(slots),
                       max_query_len=int(q_lens.max()) if rows else 0, seq_lens=i32(seq_lens))


def decode_bucket(batch_size: int, context_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int,
                  scratch_page: int) -> PagedLayout:
    """The decode layout of n <= batch_size real rows padded to batch_size rows.

    `context_lens` [n]; `block_tables` [n, P] (any width, extra entries ignored).
    Rows n.. are padding: context 0, their one token written to and read from
    slot 0 of `scratch_page`.
    """
    ctx = _ints(context_lens)
    n = ctx.size
    if n > batch_size:
        raise ValueError(f"{n} rows do not fit a graph batch of {batch_size}")
    bt = _ints(block_tables)
    if bt.ndim != 2 or bt.shape[0] != n:
        raise ValueError(f"block_tables must be [n, P] with n = {n}, got shape {tuple(bt.shape)}")
    if (ctx < 0).any():  # its rows' queries are one token each: only the contexts can be wrong
        raise ValueError("context_lens must be non-negative")
    if not bt.shape[1]:  # a table of no pages reads as one column of the scratch page
        bt = np.full((n, 1), scratch_page, dtype=np.int64)
    return _decode_layout(ctx, bt, page_size, scratch_page, batch_size - n, scratch_page)


def _decode_layout(ctx: np.ndarray, bt: np.ndarray, page_size: int, max_page_id: int, pad: int,
                   pad_page: int) -> PagedLayout:
    """`build_layout` of n rows of one new token each (`ctx` [n] >= 0, `bt`
    [n, P]), then `pad` rows of context 0 on page `pad_page`: what the
    general path gives, with no per-token gathers (every row's slot is in
    its last page), and no copy of the tables into a padded one."""
    n = ctx.size
    rows = n + pad
    pages = ctx // page_size + 1
    short = np.flatnonzero(pages > bt.shape[1])
    if short.size:
        i = int(short[0])
        raise ValueError(f"row {i} needs {int(pages[i])} pages for {int(ctx[i]) + 1} tokens, "
                         f"its block table has {bt.shape[1]}")
    # row after row, each row's first pages (int32: half the bytes to compare, the mask twice as fast)
    used = bt[np.arange(bt.shape[1], dtype=np.int32) < pages.astype(np.int32)[:, None]]
    if used.size and (used.min() < 0 or used.max() > max_page_id):
        raise ValueError(f"block_tables hold page ids outside [0, {max_page_id}]")
    kv_indptr = np.empty(rows + 1, dtype=np.int32)
    kv_indptr[0] = 0
    np.cumsum(pages, out=kv_indptr[1:n + 1])
    kv_indptr[n + 1:] = kv_indptr[n] + np.arange(1, pad + 1)
    kv_indices = np.empty(used.size + pad, dtype=np.int32)
    kv_indices[:used.size] = used
    kv_indices[used.size:] = pad_page
    seq_lens = np.ones(rows, dtype=np.int32)
    seq_lens[:n] = ctx + 1
    last_page_len = np.ones(rows, dtype=np.int32)
    last_page_len[:n] = ctx % page_size + 1
    slots = np.full(rows, pad_page * page_size, dtype=np.int64)
    slots[:n] = bt[np.arange(n), pages - 1] * page_size + ctx % page_size
    return PagedLayout(qo_indptr=torch.arange(rows + 1, dtype=torch.int32), kv_indptr=torch.from_numpy(kv_indptr),
                       kv_indices=torch.from_numpy(kv_indices), kv_last_page_len=torch.from_numpy(last_page_len),
                       slot_mapping=torch.from_numpy(slots), max_query_len=1 if rows else 0,
                       seq_lens=torch.from_numpy(seq_lens))


class _HostLens(torch.Tensor):
    """Rows' KV lengths on the host, as FlashInfer's decode `plan` takes them
    (`seq_lens`): it takes their `max()` in Python, which iterates a tensor
    as one 0-d tensor and one comparison per row (about half a millisecond
    a step at 256 rows); these iterate as numpy scalars. In every torch op
    and in FlashInfer's C++ plan they are a plain int32 tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def cpu(self, *args: Any, **kwargs: Any) -> _HostLens:
        return self

    def __iter__(self) -> Any:
        return iter(self.numpy())


def host_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """`seq_lens` (int32, on the host) for FlashInfer's decode `plan`."""
    return seq_lens.as_subclass(_HostLens)
