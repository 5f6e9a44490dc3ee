"""KVCache: the paged key/value memory of one KV component on one device.

Per layer, K and V are [num_pages + 1, page_size, num_kv_heads, head_dim] tensors
allocated once at startup; rows of a step own pages through block tables, and
attention backends write and read tokens at slot `page * page_size + offset`.
The spec's token rows (`KVSpec.token_rows`) are [num_pages + 1, page_size,
width] beside them, at the same slots, and go wherever the pages go (copies,
swaps).

`kv_dtype` is what K and V are stored in: the model's dtype, or float8 e4m3
(`--kv-cache-dtype fp8`: half the bytes a decode step reads, each key and
value rounded to e4m3 with scale 1, saturating at 448); the token rows stay
in `dtype`. torch has no index copies of float8 tensors, so float8 pages
move as their bytes (`raw`).
"""

from __future__ import annotations

import torch

from mstar.errors import ConfigError
from mstar.kernels.qkv_store import KVDest
from mstar.kernels.rope_kv import raw
from mstar.models.base import KVSpec


FP8_KV = torch.float8_e4m3fn


class KVCache:
    def __init__(self, spec: KVSpec, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ConfigError(f"KV cache needs positive num_pages and page_size, got {num_pages} and {page_size}")
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype                    # the model's: queries, token rows
        self.kv_dtype = kv_dtype or dtype     # K and V pages
        # one page more than the pool hands out: the scratch page, where the
        # padding rows of a CUDA-graph batch write and read harmlessly
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, spec.num_kv_heads, spec.head_dim)
        # zeroed, not empty: padded gathers read unused slots, and garbage there
        # could be NaN/inf, which survives a zero attention weight as NaN
        self.k: list[torch.Tensor] = [torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
                                      for _ in range(spec.num_layers)]
        self.v: list[torch.Tensor] = [torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
                                      for _ in range(spec.num_layers)]
        self.rows: dict[str, torch.Tensor] = {
            name: torch.zeros((num_pages + 1, page_size, width), device=self.device, dtype=dtype)
            for name, width in spec.token_rows}

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages of `layer`."""
        return self.k[layer], self.v[layer]

    def dest(self, layer: int, tokens: int, planned: int, kv_heads: int, head_dim: int,
             slots: torch.Tensor) -> KVDest:
        """Where a step's `tokens` new keys and values go in `layer`: its
        pages' flat views at `slots`, for a step planned for `planned` tokens
        (`AttentionContext.kv_dest` of the paged contexts)."""
        if tokens != planned or (kv_heads, head_dim) != (self.spec.num_kv_heads, self.spec.head_dim):
            raise ValueError(f"attention planned for {planned} tokens of {self.spec.num_kv_heads} KV heads of "
                             f"{self.spec.head_dim}, got {tokens} of {kv_heads} of {head_dim}")
        return KVDest(self.k[layer].view(-1, kv_heads, head_dim), self.v[layer].view(-1, kv_heads, head_dim),
                      slots=slots)

    @staticmethod
    def bytes_per_page(spec: KVSpec, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes one page takes over all layers, K and V, and its token rows."""
        kv_size = torch.empty((), dtype=kv_dtype or dtype).element_size()
        rows = sum(width for _, width in spec.token_rows) * torch.empty((), dtype=dtype).element_size()
        return (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_size + rows) * page_size

    def write_rows(self, name: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Token rows `rows` [n, width] of output `name` at `slots` [n]."""
        table = self.rows[name]
        table.view(-1, table.shape[-1]).index_copy_(0, slots.to(self.device), rows.to(table.dtype))

    def read_rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Token rows of output `name` at `slots` [n]: [n, width]."""
        table = self.rows[name]
        return table.view(-1, table.shape[-1]).index_select(0, slots.to(self.device))

    def _paged(self) -> list[torch.Tensor]:
        """Every tensor indexed by page: each layer's K and V (as `raw`), then the token rows."""
        return [raw(t) for pair in zip(self.k, self.v) for t in pair] + list(self.rows.values())

    @classmethod
    def pages_for_memory(cls, spec: KVSpec, page_size: int, dtype: torch.dtype, memory_bytes: int | float,
                         kv_dtype: torch.dtype | None = None) -> int:
        """How many pages fit in `memory_bytes`; a `ConfigError` if not even one."""
        per_page = cls.bytes_per_page(spec, page_size, dtype, kv_dtype)
        n = int(memory_bytes // per_page)
        if n < 1:
            raise ConfigError(f"KV cache memory of {int(memory_bytes)} bytes holds no page of {per_page} bytes")
        return n

    def memory_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page(self.spec, self.page_size, self.dtype, self.kv_dtype)

    def __repr__(self) -> str:
        s = self.spec
        return (f"KVCache(layers={s.num_layers}, pages={self.num_pages}, page_size={self.page_size}, "
                f"kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, {self.dtype}, pages {self.kv_dtype}, "
                f"{self.device})")

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages `src` into pages `dst`, every layer's K and V (a forked
        row's private copy of a page it shared)."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for pages in self._paged():
            pages.index_copy_(0, d, pages.index_select(0, s))

    def swap_out(self, pages: list[int]) -> "SwappedKV":
        """Copy `pages` (every layer, K and V) to host memory, queued on the
        current stream behind the steps that wrote them; the pages may be
        reused by any step queued after this call."""
        idx = torch.tensor(pages, dtype=torch.long)
        dev_idx = idx.to(self.device)
        host = []
        for t in self._paged():
            rows = t.index_select(0, dev_idx)
            buf = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self.device.type == "cuda")
            host.append(buf.copy_(rows, non_blocking=True))
        return SwappedKV(host, len(pages))

    def swap_in(self, swapped: "SwappedKV", pages: list[int]) -> None:
        """Write what `swap_out` saved into `pages` (as many as were saved)."""
        if len(pages) != swapped.num_pages:
            raise ValueError(f"{swapped.num_pages} pages were swapped out, {len(pages)} given back")
        dev_idx = torch.tensor(pages, dtype=torch.long).to(self.device)
        for t, saved in zip(self._paged(), swapped.host):
            t.index_copy_(0, dev_idx, saved.to(self.device, non_blocking=True))


class SwappedKV:
    """A preempted row's KV pages in host memory (page-locked on CUDA)."""

    def __init__(self, host: list[torch.Tensor], num_pages: int) -> None:
        self.host = host
        self.num_pages = num_pages


class PagedDest:
    """`AttentionContext.kv_dest` for a context over a `KVCache` planned for
    `num_tokens` tokens at `slot_mapping`."""

    cache: KVCache
    num_tokens: int
    slot_mapping: torch.Tensor

    def kv_dest(self, layer: int, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> KVDest:
        """Where the step's new keys and values go: the layer's pages at the
        tokens' slots."""
        return self.cache.dest(layer, tokens, self.num_tokens, kv_heads, head_dim, self.slot_mapping)
