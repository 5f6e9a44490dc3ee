"""FlashInferAttention: FlashInfer paged attention behind `AttentionContext`.

A step's rows (query_start, context_lens, block tables) go in once per step;
`plan` turns them into FlashInfer's page lists (see `paged_layout`) and plans
one wrapper: the decode wrapper when every row has one new token, the
paged-prefill wrapper otherwise (causal, or not: a block of new tokens that
attend to each other, all of them). The context it returns then takes, for every
layer, q [T, Hq, D] and the new k, v [T, Hkv, D]: it applies RoPE and writes k, v
into the layer's pages at the new tokens' slots (one fused kernel,
`mstar.kernels.rope_kv`), then attends over
(k_pages, v_pages) of `cache.layer(layer)` in NHD layout. Out: [T, Hq, D].

Over float8 pages (`--kv-cache-dtype fp8`) decode runs through XQA
(`xqa_decode.py`) where it runs, in the same places as the decode wrapper.

`plan_graph` serves CUDA-graph decode: each batch-size bucket owns a wrapper
built with `use_cuda_graph=True` over static device buffers (slot mapping,
kv_indptr, kv_indices, kv_last_page_len), refilled and re-planned before
every replay; its context touches only those buffers, so one context object
serves the capture and every replay. `plan_mixed_graph` serves CUDA-graph
mixed steps (a decode bucket's rows, then a few new rows' prompt tokens at a
padded token count): the decode rows attend through their bucket's decode
wrapper, the new rows through a graph-mode paged-prefill wrapper of the token
count, whose work split FlashInfer fixes by the bucket (its rows and total
tokens), so any split of the tokens over the rows replays.

All wrappers share one float workspace: they run one after another in stream
order (a component's decode groups run on a stream of their own, which waits
for its item steps and is waited for by them), and the workspace only holds
a kernel's split-KV partials.
A context from `plan` is valid until the next `plan`: the wrapper it uses is
re-planned then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flashinfer  # an ImportError here tells the backend chooser to fall back to torch
import torch

from mstar.engine.memory.kv_cache import KVCache, PagedDest
from mstar.engine.memory.paged_layout import PagedLayout, build_layout, decode_bucket, host_lens
from mstar.engine.memory.xqa_decode import SEMAPHORE_BYTES, XqaDecode, xqa_supported
from mstar.errors import ConfigError
from mstar.kernels.host_copy import StagingFence, to_device
from mstar.kernels.rope_kv import rope_and_store, store_kv
from mstar.types import Rotary

# FlashAttention-2 kernels for prefill (and tensor-core decode): FlashInfer's
# "auto" picks FA3 on Hopper, which needs sm_90a builds and another long JIT
# compile; our prefills are short prompts, where FA2 is not the bottleneck.
PREFILL_BACKEND = "fa2"
# Decode through the prefill kernels on tensor cores rather than the decode
# kernel on CUDA cores: ~15% faster at the Orpheus-3B shape (GQA group 3),
# batch 64, context 512 (docs/benchmarks/page_size.md).
DECODE_TENSOR_CORES = True


def build_kernels(dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None) -> None:
    """JIT-compile the prefill and decode modules in one parallel ninja run
    (a fresh machine otherwise compiles them one after another on first use)."""
    from flashinfer.jit import build_jit_specs, gen_batch_decode_module, gen_batch_prefill_module

    idx, kv = torch.int32, kv_dtype or dtype
    specs = [
        gen_batch_prefill_module(PREFILL_BACKEND, dtype, kv, dtype, idx, head_dim, head_dim, 0, False, False, False),
        gen_batch_decode_module(dtype, kv, dtype, idx, head_dim, head_dim, 0, False, False),
    ]
    build_jit_specs(specs, verbose=False)


class FlashInferContext(PagedDest):
    """`AttentionContext` over one planned FlashInfer wrapper (`kv_dest`: `PagedDest`)."""

    def __init__(self, cache: KVCache, wrapper: Any, slot_mapping: torch.Tensor, num_tokens: int) -> None:
        self.cache = cache
        self.wrapper = wrapper
        self.slot_mapping = slot_mapping    # [T] int64 on the cache's device
        self.num_tokens = num_tokens

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float, rotary: Rotary | None = None) -> torch.Tensor:
        t = q.shape[0]
        if t != self.num_tokens or k.shape[0] != t or v.shape[0] != t:
            raise ValueError(f"attention planned for {self.num_tokens} tokens, "
                             f"got q/k/v of {t}/{k.shape[0]}/{v.shape[0]}")
        k_pages, v_pages = self.cache.layer(layer)
        if rotary is None:
            store_kv(k, v, k_pages, v_pages, self.slot_mapping)
        else:  # fused: k is rotated on its way into the pages
            q = rope_and_store(q, k, v, rotary.cos, rotary.sin, rotary.positions, k_pages, v_pages,
                               self.slot_mapping)
        if t == 0:
            return q.new_empty(0, q.shape[1], q.shape[2])
        return self.attend(layer, q, scale)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention alone, over keys already in the cache: [T, Hq, D] out."""
        if q.shape[0] == 0:
            return q.new_empty(0, q.shape[1], q.shape[2])
        k_pages, v_pages = self.cache.layer(layer)
        # FlashInfer fixes sm_scale at plan time, before the model says it; its
        # per-call q_scale multiplies the default 1/sqrt(D), so this gives `scale`
        q_scale = scale * math.sqrt(q.shape[-1])
        out = self.wrapper.run(q.to(self.cache.dtype).contiguous(), (k_pages, v_pages), q_scale=q_scale)
        return out.to(q.dtype)


class MixedContext(FlashInferContext):
    """A mixed step's context: its first `split` tokens (one per decode row)
    attend through a decode wrapper, the rest (new rows' prompt tokens)
    through a paged-prefill one; the new keys of both go into the pages in
    one pass."""

    def __init__(self, cache: KVCache, decode: Any, prefill: Any, slot_mapping: torch.Tensor, split: int) -> None:
        super().__init__(cache, decode, slot_mapping, slot_mapping.numel())
        self.prefill = prefill
        self.split = split

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k_pages, v_pages = self.cache.layer(layer)
        q_scale = scale * math.sqrt(q.shape[-1])
        dtype = q.dtype
        q = q.to(self.cache.dtype).contiguous()
        out = torch.empty_like(q)
        self.wrapper.run(q[:self.split], (k_pages, v_pages), q_scale=q_scale, out=out[:self.split])
        self.prefill.run(q[self.split:], (k_pages, v_pages), q_scale=q_scale, out=out[self.split:])
        return out.to(dtype)


class _PrefillBucket:
    """The new rows' half of mixed-step graphs of `tokens` new tokens: a
    graph-mode paged-prefill wrapper over `rows` new rows and a padding row,
    with its static buffers and page-locked staging."""

    def __init__(self, owner: FlashInferAttention, tokens: int, rows: int, max_pages_per_row: int) -> None:
        dev = owner.cache.device
        self.tokens, self.rows = tokens, rows
        self.max_pages = rows * max_pages_per_row + -(-tokens // owner.cache.page_size)
        n = rows + 1
        i32 = dict(dtype=torch.int32, device=dev)
        self.qo_indptr, self.kv_indptr = torch.zeros(n + 1, **i32), torch.zeros(n + 1, **i32)
        self.kv_indices, self.kv_last_page_len = torch.zeros(self.max_pages, **i32), torch.zeros(n, **i32)
        self.indices_stage = torch.zeros(self.max_pages, **i32)
        pin = dict(dtype=torch.int32, pin_memory=True)
        self.pinned_qo, self.pinned_indptr = torch.empty(n + 1, **pin), torch.empty(n + 1, **pin)
        self.pinned_last, self.pinned_indices = torch.empty(n, **pin), torch.empty(self.max_pages, **pin)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            owner.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
            paged_kv_indptr_buf=self.kv_indptr, paged_kv_indices_buf=self.kv_indices,
            paged_kv_last_page_len_buf=self.kv_last_page_len, backend=PREFILL_BACKEND)


class _GraphBucket:
    """Static buffers, a CUDA-graph wrapper and the one context of a batch size."""

    def __init__(self, owner: FlashInferAttention, batch_size: int, max_pages_per_row: int) -> None:
        dev = owner.cache.device
        self.batch_size = batch_size
        self.max_pages = batch_size * max_pages_per_row
        # start from the all-padding layout, so a capture that runs before the
        # first real plan reads valid pages
        empty = decode_bucket(batch_size, torch.zeros(0), torch.zeros(0, 1), owner.cache.page_size,
                              owner.cache.scratch_page)
        self.slot_mapping = empty.slot_mapping.to(dev)
        self.kv_indptr = empty.kv_indptr.to(dev)
        self.kv_indices = torch.zeros(self.max_pages, dtype=torch.int32, device=dev)
        self.kv_indices[:empty.kv_indices.numel()] = empty.kv_indices.to(dev)
        self.kv_last_page_len = empty.kv_last_page_len.to(dev)
        # host staging in page-locked memory, so that every copy a plan makes
        # is asynchronous and the host need not wait for the step in flight;
        # the caller waits for the previous plan's copies before reusing these
        self.pinned_indptr = torch.empty(batch_size + 1, dtype=torch.int32, pin_memory=True)
        self.pinned_last = torch.empty(batch_size, dtype=torch.int32, pin_memory=True)
        self.pinned_indices = torch.empty(self.max_pages, dtype=torch.int32, pin_memory=True)
        self.pinned_slots = torch.empty(batch_size, dtype=torch.int64, pin_memory=True)
        # FlashInfer copies host page indices synchronously: hand it device ones
        self.indices_stage = torch.zeros(self.max_pages, dtype=torch.int32, device=dev)
        if owner.xqa:
            self.wrapper: Any = owner.xqa_decode(batch_size, max_pages_per_row)
        else:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                owner.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=owner.decode_tensor_cores,
                paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.kv_last_page_len)
        self.context = FlashInferContext(owner.cache, self.wrapper, self.slot_mapping, batch_size)


class FlashInferAttention:
    """Owns FlashInfer wrappers + workspace for one KVCache on one CUDA device."""

    def __init__(self, cache: KVCache, num_qo_heads: int, *, graph_batch_sizes: Sequence[int] = (),
                 max_pages_per_row: int, workspace_bytes: int = 256 << 20,
                 decode_tensor_cores: bool = DECODE_TENSOR_CORES, mixed_tokens: Sequence[int] = (),
                 mixed_rows: int = 0, mixed_buckets: Sequence[int] | None = None, split_kv: bool = True) -> None:
        """`mixed_tokens`, `mixed_rows`: the new tokens and most new rows of
        the mixed-step graphs (`plan_mixed_graph`), beside each decode bucket
        of `mixed_buckets` (default: every one). `split_kv` False: bf16
        decode never splits a row's keys over programs (no partials to
        merge, one program per row and KV head)."""
        if cache.device.type != "cuda":
            raise ConfigError(f"FlashInfer attention needs a CUDA device, the KV cache is on {cache.device}")
        if num_qo_heads < 1 or num_qo_heads % cache.spec.num_kv_heads:
            raise ConfigError(f"{num_qo_heads} query heads do not group over {cache.spec.num_kv_heads} KV heads")
        if max_pages_per_row < 1:
            raise ConfigError("max_pages_per_row must be positive")
        self.cache = cache
        self.num_qo_heads = num_qo_heads
        self.max_pages_per_row = max_pages_per_row
        self.decode_tensor_cores = decode_tensor_cores
        self.split_kv = split_kv
        # what every plan() of every wrapper is told: the pages' shape and dtype
        self._dims = (num_qo_heads, cache.spec.num_kv_heads, cache.spec.head_dim, cache.page_size)
        self._dtypes = dict(q_data_type=cache.dtype, kv_data_type=cache.kv_dtype)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=cache.device)
        # float8 pages decode through XQA where it runs (xqa_decode.py); prefill stays FlashInfer's
        self.xqa = xqa_supported(cache)
        self._semaphores = torch.zeros(SEMAPHORE_BYTES, dtype=torch.uint8, device=cache.device) if self.xqa else None
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=PREFILL_BACKEND)
        self._decode: Any = self.xqa_decode() if self.xqa else flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=decode_tensor_cores)
        self._buckets = {b: _GraphBucket(self, b, max_pages_per_row) for b in sorted(set(graph_batch_sizes))}
        # the graph sets replaying into these buckets (decode, mixed, a KV mode's) rewrite the same page-locked
        # staging: each waits, through this one fence, for the last replay's copies, whichever set made it
        self.fence = StagingFence()
        # an eager plan writes its plan info into its wrapper's one page-locked buffer and copies it out
        # asynchronously: the next plan of that wrapper must not rewrite the buffer before that copy has run
        self._prefill_fence, self._decode_fence = StagingFence(), StagingFence()
        self.mixed_rows = mixed_rows
        self._prefills = {t: _PrefillBucket(self, t, mixed_rows, max_pages_per_row)
                          for t in sorted(set(mixed_tokens))} if mixed_rows and self._buckets else {}
        self._mixed_buckets = [b for b in self._buckets if mixed_buckets is None or b in mixed_buckets]
        top = max(self._buckets, default=0) + max(self._prefills, default=0)
        self._mixed_slots = torch.zeros(top, dtype=torch.long, device=cache.device)
        self._pinned_mixed_slots = torch.empty(top, dtype=torch.long, pin_memory=True)
        self._mixed: dict[tuple[int, int], MixedContext] = {}

    def xqa_decode(self, rows: int | None = None, width: int = 0) -> XqaDecode:
        """An XQA decode plan sharing this backend's workspace (as scratch) and semaphores."""
        return XqaDecode(self.cache, self.num_qo_heads, self.workspace, self._semaphores, rows, width)

    def _plan_decode(self, wrapper: Any, layout: PagedLayout) -> None:
        if self.xqa:
            wrapper.plan(layout)
            return
        wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len, *self._dims,
                     seq_lens=host_lens(layout.seq_lens), disable_split_kv=not self.split_kv, **self._dtypes)

    def plan(self, query_start: torch.Tensor, context_lens: torch.Tensor,
             block_tables: torch.Tensor | list[list[int]], causal: bool = True) -> FlashInferContext:
        """The context of one eager step; `context_lens` counts the tokens of
        each row already cached, `block_tables` its page ids in order. One new
        token per row attends to every key either way."""
        layout = build_layout(query_start, context_lens, block_tables, self.cache.page_size, self.cache.scratch_page)
        slots = to_device(layout.slot_mapping, self.cache.device)  # page-locked: queues behind the steps in flight
        if layout.num_tokens == 0:  # nothing to attend; FlashInfer's planners divide by the batch size
            return FlashInferContext(self.cache, None, slots, 0)
        wrapper, fence = (self._decode, self._decode_fence) if layout.is_decode else (self._prefill, self._prefill_fence)
        fence.wait()
        if layout.is_decode:
            self._plan_decode(wrapper, layout)
        else:
            wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len,
                         *self._dims, causal=causal, **self._dtypes)
        fence.record()
        return FlashInferContext(self.cache, wrapper, slots, layout.num_tokens)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        return tuple(self._buckets)

    def plan_graph(self, batch_size: int, context_lens: torch.Tensor, block_tables: torch.Tensor) -> FlashInferContext:
        """Refill bucket `batch_size`'s static buffers for n <= batch_size decode
        rows (`context_lens` [n], `block_tables` [n, P] on the host; rows n.. pad
        onto the scratch page) and re-plan its wrapper; the bucket's one context."""
        bucket = self._buckets.get(batch_size)
        if bucket is None:
            raise ValueError(f"no CUDA-graph bucket of batch size {batch_size} (have {self.graph_batch_sizes})")
        layout = decode_bucket(batch_size, context_lens, block_tables, self.cache.page_size, self.cache.scratch_page)
        self._plan_bucket(bucket, layout)
        return bucket.context

    def _plan_bucket(self, bucket: _GraphBucket, layout: PagedLayout) -> None:
        widest = int((layout.kv_indptr[1:] - layout.kv_indptr[:-1]).max())
        if widest > self.max_pages_per_row:
            raise ValueError(f"a row needs {widest} pages, graph buckets hold {self.max_pages_per_row} a row")
        # every copy below is from page-locked memory, so none of them blocks
        # the host; all run in stream order before the replay
        bucket.pinned_slots.copy_(layout.slot_mapping)
        bucket.slot_mapping.copy_(bucket.pinned_slots, non_blocking=True)
        if self.xqa:
            bucket.wrapper.plan(layout)
            return
        n = layout.kv_indices.numel()
        bucket.pinned_indptr.copy_(layout.kv_indptr)
        bucket.pinned_last.copy_(layout.kv_last_page_len)
        bucket.pinned_indices[:n].copy_(layout.kv_indices)
        bucket.indices_stage[:n].copy_(bucket.pinned_indices[:n], non_blocking=True)
        bucket.wrapper.plan(bucket.pinned_indptr, bucket.indices_stage[:n], bucket.pinned_last, *self._dims,
                            non_blocking=True, seq_lens=host_lens(layout.seq_lens), disable_split_kv=not self.split_kv,
                            **self._dtypes)

    @property
    def mixed_graph_buckets(self) -> list[tuple[int, int]]:
        """(decode rows, new tokens) of every mixed-step graph this backend plans."""
        return [(b, t) for b in self._mixed_buckets for t in self._prefills]

    def plan_mixed_graph(self, batch_size: int, tokens: int, context_lens: torch.Tensor, block_tables: torch.Tensor,
                         new_query_start: torch.Tensor, new_context_lens: torch.Tensor,
                         new_tables: torch.Tensor) -> MixedContext:
        """Plan mixed bucket (`batch_size` decode rows, `tokens` new tokens):
        n decode rows (`context_lens` [n], `block_tables` [n, P]) padded as
        `plan_graph` pads them, then m <= `mixed_rows` new rows
        (`new_query_start` [m + 1] from 0, `new_context_lens`, `new_tables`
        [m, P']); unused new-row slots take one token each and a last row
        the tokens left (at least one), all on the scratch page. The step's
        packed tokens: the bucket's decode rows, then the new rows'. Returns
        the bucket's one context."""
        bucket, pre = self._buckets[batch_size], self._prefills[tokens]
        page, scratch = self.cache.page_size, self.cache.scratch_page
        dec = decode_bucket(batch_size, context_lens, block_tables, page, scratch)
        self._plan_bucket(bucket, dec)
        lens = (new_query_start[1:] - new_query_start[:-1]).tolist()
        m = len(lens)
        spare = tokens - sum(lens) - (pre.rows - m)
        if m > pre.rows or spare < 1:
            raise ValueError(f"{m} new rows of {sum(lens)} tokens do not fit a mixed bucket of {tokens}")
        q_lens = lens + [1] * (pre.rows - m) + [spare]
        query_start = torch.zeros(pre.rows + 2, dtype=torch.long)
        query_start[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.long), 0)
        width = max(new_tables.shape[1] if m else 1, -(-spare // page))
        tables = torch.full((pre.rows + 1, width), scratch, dtype=torch.long)
        if m:
            tables[:m, :new_tables.shape[1]] = new_tables
        ctx = torch.zeros(pre.rows + 1, dtype=torch.long)
        ctx[:m] = new_context_lens
        lay = build_layout(query_start, ctx, tables, page, scratch)
        k = lay.kv_indices.numel()
        if k > pre.max_pages:
            raise ValueError(f"new rows need {k} pages, the mixed bucket holds {pre.max_pages}")
        pre.pinned_qo.copy_(lay.qo_indptr)
        pre.pinned_indptr.copy_(lay.kv_indptr)
        pre.pinned_last.copy_(lay.kv_last_page_len)
        pre.pinned_indices[:k].copy_(lay.kv_indices)
        pre.indices_stage[:k].copy_(pre.pinned_indices[:k], non_blocking=True)
        pre.wrapper.plan(pre.pinned_qo, pre.pinned_indptr, pre.indices_stage[:k], pre.pinned_last, *self._dims,
                         causal=True, non_blocking=True, **self._dtypes)
        total = batch_size + tokens
        self._pinned_mixed_slots[:batch_size].copy_(dec.slot_mapping)
        self._pinned_mixed_slots[batch_size:total].copy_(lay.slot_mapping)
        self._mixed_slots[:total].copy_(self._pinned_mixed_slots[:total], non_blocking=True)
        ctx_obj = self._mixed.get((batch_size, tokens))
        if ctx_obj is None:
            ctx_obj = self._mixed[(batch_size, tokens)] = MixedContext(
                self.cache, bucket.wrapper, pre.wrapper, self._mixed_slots[:total], batch_size)
        return ctx_obj
