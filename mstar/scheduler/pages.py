"""Page accounting for one paged KV cache: which pages are free, and how many
holders each used page has. Pure bookkeeping: the KV tensors live in the engine.

Allocation is all-or-nothing: a caller gets every page it asked for or none,
so a request is never half-admitted.
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first, which keeps
        # small workloads in a compact, cache-friendly part of the pool.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages with one holder each, or None if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a holder to pages already in use (a shared prefix)."""
        for p in pages:
            if self._refs[p] == 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page with none left is free again."""
        for p in pages:
            refs = self._refs[p]
            if refs == 0:
                raise ValueError(f"page {p} is freed twice")
            self._refs[p] = refs - 1
            if refs == 1:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
