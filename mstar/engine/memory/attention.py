"""TorchPagedAttention: the reference attention over the paged KV cache.

A step's rows and their pages in (query_start, context_lens, block_tables),
planned once; then, for every layer, packed q [T, Hq, D] and new k/v
[T, Hkv, D] (and the step's `Rotary`, applied as k is written) in, attention
output [T, Hq, D] out. Plain torch attention, so it runs on CPU and CUDA alike
and is what faster backends are tested against; the RoPE + KV write goes
through `mstar.kernels.rope_kv` (its torch reference on CPU).

The plan lays rows out padded: queries [B, Qmax], keys [B, L] gathered from
each row's pages, and a [B, Qmax, L] mask: causal, or, planned non-causal,
every key of the row (its cache and all its new tokens). All rows run in one
attention call, so prefill rows (many tokens, maybe no cached context) and
decode rows (one token) mix freely in a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mstar.engine.memory.kv_cache import KVCache, PagedDest
from mstar.kernels.rope_kv import rope_and_store, store_kv, take_rows
from mstar.types import Rotary

# score tensors beyond this are computed a group of rows at a time, so a long
# prefill batched with many decodes does not allocate B * Qmax * L at once
SCORE_BUDGET_BYTES = 1 << 30


def _padded_block_tables(block_tables: torch.Tensor | Sequence[Sequence[int]],
                         rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, P] int64 page ids on the host, and each row's table length when
    the tables came as lists (a padded tensor does not say)."""
    lengths = None
    if isinstance(block_tables, torch.Tensor):
        bt = block_tables.to(device="cpu", dtype=torch.int64)
    else:
        lengths = torch.tensor([len(r) for r in block_tables], dtype=torch.int64)
        bt = torch.zeros(len(block_tables), max(int(lengths.max()) if len(lengths) else 0, 1), dtype=torch.int64)
        for i, pages in enumerate(block_tables):  # host-side conversion of the scheduler's lists
            bt[i, :len(pages)] = torch.as_tensor(list(pages), dtype=torch.int64)
    if bt.dim() != 2 or bt.shape[0] != rows:
        raise ValueError(f"block_tables must have one row per batch row ({rows}), got shape {tuple(bt.shape)}")
    if bt.shape[1] == 0:
        bt = torch.zeros(rows, 1, dtype=torch.int64)
    return bt, lengths


class TorchPagedAttention(PagedDest):
    """`AttentionContext` over a `KVCache`, planned for one step (`kv_dest`: `PagedDest`).

    `query_start` [B + 1] (CPU int64): row i owns packed tokens
    [query_start[i], query_start[i + 1]). `context_lens` [B]: tokens of each
    row already in the cache before this step; its new tokens take positions
    context_lens[i], context_lens[i] + 1, ... `block_tables`: per row, the page
    ids holding its positions in order (page j holds positions
    [j * page_size, (j + 1) * page_size)); a list of lists, or a [B, P] tensor
    padded with any valid page id.
    """

    def __init__(self, cache: KVCache, query_start: torch.Tensor, context_lens: torch.Tensor | Sequence[int],
                 block_tables: torch.Tensor | Sequence[Sequence[int]], causal: bool = True) -> None:
        self.cache = cache
        ps = cache.page_size
        qs = torch.as_tensor(query_start, dtype=torch.int64).cpu()
        ctx = torch.as_tensor(context_lens, dtype=torch.int64).cpu()
        rows = qs.numel() - 1
        if rows < 0 or ctx.shape != (rows,):
            raise ValueError(f"query_start [B+1] and context_lens [B] disagree: {tuple(qs.shape)} vs "
                             f"{tuple(ctx.shape)}")
        q_lens = qs[1:] - qs[:-1]
        if (q_lens < 0).any() or (ctx < 0).any():
            raise ValueError("query_start must be non-decreasing and context_lens non-negative")
        bt, have = _padded_block_tables(block_tables, rows)
        seq_lens = ctx + q_lens
        pages_needed = (seq_lens + ps - 1) // ps
        if have is not None:
            short = (pages_needed > have).nonzero().flatten()
            if short.numel():
                i = int(short[0])
                raise ValueError(f"row {i} needs {int(pages_needed[i])} pages for {int(seq_lens[i])} tokens, "
                                 f"its block table has {int(have[i])}")
        used = torch.arange(bt.shape[1])[None, :] < pages_needed[:, None]
        if ((bt < 0) | (bt > cache.scratch_page))[used].any():
            raise ValueError(f"block_tables hold page ids outside [0, {cache.scratch_page}]")

        self.num_rows = rows
        self.num_tokens = int(qs[-1] - qs[0]) if rows else 0
        self.query_start = qs
        self.context_lens = ctx
        self.seq_lens = seq_lens
        self.max_query_len = int(q_lens.max()) if rows else 0
        self.max_seq_len = int(seq_lens.max()) if rows else 0

        # per new token: its row, its index within the row, its position
        row = torch.repeat_interleave(torch.arange(rows), q_lens)
        idx = torch.arange(self.num_tokens) + qs[0] - qs[row]
        pos = ctx[row] + idx
        slot_mapping = bt[row, pos // ps] * ps + pos % ps
        # per row and key position: the cache slot to read (beyond the row's
        # length any valid slot will do, the mask hides it)
        key_pos = torch.arange(self.max_seq_len)
        page_col = (key_pos // ps).clamp(max=bt.shape[1] - 1)
        gather = bt[:, page_col] * ps + key_pos % ps
        gather = torch.where(key_pos[None, :] < seq_lens[:, None], gather, 0)
        # query j of a row sits at position ctx + j and sees keys at positions <= it;
        # padded queries (j >= q_len) see something harmless and are discarded
        if causal:
            q_pos = ctx[:, None] + torch.arange(self.max_query_len)[None, :]
            mask = key_pos[None, None, :] <= q_pos[:, :, None]
        else:
            mask = (key_pos[None, :] < seq_lens[:, None])[:, None, :].expand(rows, self.max_query_len, -1)

        dev = cache.device
        self.slot_mapping = slot_mapping.to(dev, non_blocking=True)
        self.gather_slots = gather.to(dev, non_blocking=True)      # [B, L]
        self.mask = mask.to(dev, non_blocking=True)                # [B, Qmax, L]
        self.query_slots = (row * self.max_query_len + idx).to(dev, non_blocking=True)  # [T] into B * Qmax

    def _row_groups(self, num_heads: int) -> list[slice]:
        per_row = max(1, num_heads * self.max_query_len * self.max_seq_len * 4)
        step = max(1, SCORE_BUDGET_BYTES // per_row)
        return [slice(i, min(i + step, self.num_rows)) for i in range(0, self.num_rows, step)]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                rotary: Rotary | None = None) -> torch.Tensor:
        t, hq, d = q.shape
        if t != self.num_tokens or k.shape[0] != t or v.shape[0] != t:
            raise ValueError(f"attention planned for {self.num_tokens} tokens, got q/k/v of "
                             f"{t}/{k.shape[0]}/{v.shape[0]}")
        k_pages, v_pages = self.cache.layer(layer)
        hkv = k_pages.shape[2]
        if hq % hkv:
            raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
        if rotary is None:
            store_kv(k, v, k_pages, v_pages, self.slot_mapping)
        else:
            q = rope_and_store(q, k, v, rotary.cos, rotary.sin, rotary.positions, k_pages, v_pages,
                               self.slot_mapping)
        return self.attend(layer, q, scale)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention alone, over keys already in the cache: [T, Hq, D] out."""
        t, hq, d = q.shape
        k_pages, v_pages = self.cache.layer(layer)
        hkv = k_pages.shape[2]
        if hq % hkv:
            raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
        k_flat = k_pages.view(-1, hkv, d)
        v_flat = v_pages.view(-1, hkv, d)
        if t == 0:
            return q.new_empty(0, hq, d)

        b, qmax = self.num_rows, self.max_query_len
        q_pad = q.new_zeros(b * qmax, hq, d, dtype=torch.float32)
        q_pad[self.query_slots] = q.float()
        q_pad = q_pad.view(b, qmax, hq, d).transpose(1, 2)               # [B, Hq, Qmax, D]
        out = torch.empty_like(q_pad)
        group = hq // hkv
        for rows in self._row_groups(hq):
            keys = take_rows(k_flat, self.gather_slots[rows]).float().transpose(1, 2)    # [b, Hkv, L, D]
            values = take_rows(v_flat, self.gather_slots[rows]).float().transpose(1, 2)
            if group > 1:  # GQA by repeating KV heads: SDPA's enable_gqa needs torch >= 2.5
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            out[rows] = F.scaled_dot_product_attention(
                q_pad[rows], keys, values, attn_mask=self.mask[rows].unsqueeze(1), scale=scale)
        out = out.transpose(1, 2).reshape(b * qmax, hq, d)
        return out[self.query_slots].to(q.dtype)
