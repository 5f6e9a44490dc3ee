"""Page accounting for one paged KV cache: which pages are free, how many
holders each used page has, and which unheld pages still keep a cached
prefix (`prefix_cache.py`) until the pool needs them. Pure bookkeeping: the
KV tensors live in the engine.

Allocation is all-or-nothing: a caller gets every page it asked for or none,
so a request is never half-admitted. Cached pages nobody holds count as
free: an allocation that runs out of never-used pages takes them, least
recently used first, and tells the cache they are gone (`on_evict`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class PagePool:
    def __init__(self, num_pages: int, page_size: int, token_rows: frozenset[str] = frozenset()) -> None:
        """`token_rows`: the outputs whose every token's row the pages keep
        beside the KV (`KVSpec.token_rows`)."""
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self.token_rows = token_rows
        # Pop from the end: low page ids are handed out first, which keeps
        # small workloads in a compact, cache-friendly part of the pool.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * num_pages
        self._kept: list[bool] = [False] * num_pages       # holds a cached prefix
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept pages no one holds, least recently used first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: never used, or cached and unheld."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages some row holds."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Unheld pages kept for the prefix cache."""
        return len(self._idle)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages with one holder each, or None if fewer are free."""
        if n > self.num_free:
            return None
        if n == 0:
            return []
        fresh = min(n, len(self._free))
        pages = self._free[len(self._free) - fresh:]
        del self._free[len(self._free) - fresh:]
        while len(pages) < n:
            page, _ = self._idle.popitem(last=False)
            self._kept[page] = False
            if self.on_evict is not None:
                self.on_evict(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a holder to pages already in use (a shared prefix), or to
        cached pages no one holds."""
        for p in pages:
            if self._refs[p] == 0:
                if p not in self._idle:
                    raise ValueError(f"page {p} is free and cannot be shared")
                del self._idle[p]
            self._refs[p] += 1

    def keep(self, page: int) -> None:
        """`page` holds a cached prefix: when its last holder leaves it stays
        as it is until an allocation needs it."""
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is free and cannot be kept")
        self._kept[page] = True

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page with none left is free again
        (a kept one at the back of the cached pages' line)."""
        for p in pages:
            refs = self._refs[p]
            if refs == 0:
                raise ValueError(f"page {p} is freed twice")
            self._refs[p] = refs - 1
            if refs == 1:
                if self._kept[p]:
                    self._idle[p] = None
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
