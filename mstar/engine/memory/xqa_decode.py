"""XqaDecode: decode attention over float8 KV pages through TensorRT-LLM's
XQA kernel (FlashInfer's `xqa`), behind the same `plan` / `run` calls as
FlashInfer's decode wrappers.

A decode step's `PagedLayout` (one new token per row) goes in; XQA reads a
dense page table [B, W] int32 and each row's length [B] (uint32), so `plan`
turns the layout's page lists into those, padding tables with the scratch
page. There is no planner: `plan` is a host-side rewrite of two small
arrays, and a CUDA-graph bucket's table and lengths are static buffers
refilled before each replay. `run` takes q [B, Hq, D] in the model's dtype
and the layer's (K, V) pages in float8 e4m3; out [B, Hq, D] in q's dtype.

Why XQA: FlashInfer's decode kernels, given bf16 queries, read float8 pages
at 1.2-1.6 TB/s on an H200, slower than over bf16 pages; XQA's Hopper kernel
reads them at ~3.5 TB/s (docs/benchmarks/analysis.md), so a float8 cache
halves decode attention's time. It multiplies in float8: the queries (unscaled,
so a query element past 448 saturates) and the softmax's probabilities are
rounded to e4m3 as well as the pages; on the H200 its outputs differed from the
float32 reference over the same pages by at most 0.15 (tests/test_flashinfer_attention.py).
"""

from __future__ import annotations

import os

import numpy as np
import structlog
import torch

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.paged_layout import PagedLayout
from mstar.kernels.host_copy import to_device

log = structlog.get_logger("mstar.xqa")

SEMAPHORE_BYTES = 8 << 20   # XQA's split-sequence semaphores: zero at rest, left zero by every launch


def xqa_supported(cache: KVCache) -> bool:
    """XQA serves float8 pages of 16-128 tokens with fp16/bf16 queries on
    compute capability 9.x, 10.x and 12.x. Its Hopper kernel needs a build for
    sm_90a: FlashInfer builds for it unless FLASHINFER_CUDA_ARCH_LIST names a
    plain 9.0, in which case the kernel would only trap, so decode stays
    FlashInfer's."""
    if not (cache.device.type == "cuda" and cache.kv_dtype == torch.float8_e4m3fn
            and cache.dtype in (torch.float16, torch.bfloat16) and cache.page_size in (16, 32, 64, 128)):
        return False
    major = torch.cuda.get_device_capability(cache.device)[0]
    archs = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "").split()
    if major == 9 and archs and "9.0a" not in archs:
        log.warning("FLASHINFER_CUDA_ARCH_LIST has no 9.0a: float8 pages decode through FlashInfer, not XQA",
                    archs=archs)
        return False
    return major in (9, 10, 12)


def dense_tables(layout: PagedLayout, page_size: int, scratch_page: int,
                 width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The layout's rows as a page table [B, W] (W: `width`, or the widest
    row) padded with `scratch_page`, and each row's tokens [B], int32."""
    indptr = layout.kv_indptr.numpy().astype(np.int64)
    pages = np.diff(indptr)
    rows = pages.size
    w = width or max(int(pages.max()) if rows else 1, 1)
    if rows and int(pages.max()) > w:
        raise ValueError(f"a row needs {int(pages.max())} pages, the table holds {w}")
    table = np.full((rows, w), scratch_page, dtype=np.int32)
    row = np.repeat(np.arange(rows), pages)
    table[row, np.arange(indptr[-1]) - indptr[:-1][row]] = layout.kv_indices.numpy()
    lens = np.where(pages > 0, (pages - 1) * page_size + layout.kv_last_page_len.numpy(), 0).astype(np.int32)
    return table, lens


class XqaDecode:
    """One decode plan over a `KVCache` of float8 pages: eager (`rows` None,
    tables sized per plan) or a CUDA-graph bucket of `rows` rows and `width`
    pages a row (static device buffers, page-locked staging)."""

    def __init__(self, cache: KVCache, num_qo_heads: int, scratch: torch.Tensor, semaphores: torch.Tensor,
                 rows: int | None = None, width: int = 0) -> None:
        from flashinfer.xqa import xqa   # an ImportError belongs to the caller's backend choice

        self._xqa = xqa
        self.cache = cache
        self.num_qo_heads = num_qo_heads
        self.scratch = scratch
        self.semaphores = semaphores
        self.sm_count = torch.cuda.get_device_properties(cache.device).multi_processor_count
        self.rows = rows
        self.table: torch.Tensor | None = None
        self.lens: torch.Tensor | None = None
        if rows is not None:
            dev = cache.device
            # every row padding until the first plan: a capture before it reads the scratch page
            self.table = torch.full((rows, width), cache.scratch_page, dtype=torch.int32, device=dev)
            self.lens = torch.ones(rows, dtype=torch.int32, device=dev)
            self.pinned_table = torch.empty(rows, width, dtype=torch.int32, pin_memory=True)
            self.pinned_lens = torch.empty(rows, dtype=torch.int32, pin_memory=True)

    def plan(self, layout: PagedLayout) -> None:
        """This step's rows (each with its one new token counted in its length)."""
        if not layout.is_decode:
            raise ValueError("XQA decodes one new token per row")
        if self.rows is None:
            table, lens = dense_tables(layout, self.cache.page_size, self.cache.scratch_page)
            self.table = to_device(torch.from_numpy(table), self.cache.device)
            self.lens = to_device(torch.from_numpy(lens), self.cache.device)
            return
        if layout.num_rows != self.rows:
            raise ValueError(f"a bucket of {self.rows} rows planned with {layout.num_rows}")
        table, lens = dense_tables(layout, self.cache.page_size, self.cache.scratch_page, self.pinned_table.shape[1])
        # the caller has waited for the last replay's copies out of this staging (its fence)
        self.pinned_table.numpy()[:] = table
        self.pinned_lens.numpy()[:] = lens
        self.table.copy_(self.pinned_table, non_blocking=True)
        self.lens.copy_(self.pinned_lens, non_blocking=True)

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], q_scale: float = 1.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D] over the planned rows: out [B, Hq, D]; `q_scale`
        multiplies the default softmax scale 1/sqrt(D), as FlashInfer's does."""
        if self.table is None or q.shape[0] != self.table.shape[0]:
            raise ValueError(f"XQA planned for {0 if self.table is None else self.table.shape[0]} rows, "
                             f"got q of {q.shape[0]}")
        k_pages, v_pages = kv
        out = torch.empty_like(q) if out is None else out
        self._xqa(q.contiguous().unsqueeze(1), k_pages, v_pages, self.table, self.lens.view(torch.uint32).unsqueeze(1),
            out.unsqueeze(1), self.scratch, self.semaphores, self.cache.spec.num_kv_heads, self.cache.page_size,
            q_scale=q_scale, kv_scale=1.0, sm_count=self.sm_count)
        return out
