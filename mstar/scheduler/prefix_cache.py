"""The prefix cache of one paged KV pool: full pages of KV keyed by a hash
chain of the tokens that wrote them, so a row whose prompt starts with the
same tokens shares those pages instead of computing them again.

A page's key is a digest of its parent page's key, its own tokens and a salt
(what else decides the KV: the component, and for multimodal prompts a
digest of the media): equal keys mean an equal prefix at equal positions.
Pages enter once the step that wrote them has run (`insert`); a row admitted
with a hit holds them like any shared page (`PagePool.share`). The pool keeps
unheld cached pages until an allocation needs them and then tells the cache
(`evicted`), least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from mstar.scheduler.pages import PagePool
from mstar.scheduler.work import WorkItem


def page_keys(ids: Sequence[int], page_size: int, salt: bytes = b"",
              columns: Sequence[Sequence[int]] = ()) -> tuple[bytes, ...]:
    """The hash chain of the full pages of `ids` (a prompt's token ids from
    position 0): one key per full page. `columns`: more per-token ints that
    decide the KV (a multimodal prompt's positions), hashed along."""
    return page_keys_of(array("q", ids).tobytes(), page_size, salt, [array("q", c).tobytes() for c in columns])


def page_keys_of(data: bytes, page_size: int, salt: bytes = b"", columns: Sequence[bytes] = ()) -> tuple[bytes, ...]:
    """`page_keys` of ids already as int64 bytes in the machine's order (a
    tensor's: a prompt's ids reach here without a list of ints, each
    converted back to 8 bytes), `columns` the same way."""
    width = page_size * 8
    view = memoryview(data)
    cols = [memoryview(c) for c in columns]
    blake2b = hashlib.blake2b
    keys: list[bytes] = []
    parent = salt
    for start in range(0, len(data) - width + 1, width):
        h = blake2b(parent, digest_size=16)
        h.update(view[start:start + width])
        for column in cols:
            h.update(column[start:start + width])
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


def usable_pages(item: WorkItem, page_size: int) -> int:
    """Full pages of `item`'s prompt it could take from a prefix cache (its
    last token is always computed, for the step's logits)."""
    return min(len(item.prefix), (item.num_tokens - 1) // page_size, item.pages_needed)


def shared_tokens(start: Sequence[bytes], computing: set[bytes], page_size: int) -> int:
    """Tokens of a prompt's start (its page keys) that the pages `computing`
    hold: page keys chain their prefixes, so the leading keys found are
    shared."""
    n = 0
    for key in start:
        if key not in computing:
            break
        n += 1
    return n * page_size


@dataclass(slots=True)
class CacheStats:
    queries: int = 0        # prompt tokens of the rows admitted with a lookup
    hits: int = 0           # of those, tokens whose KV came from the cache
    inserted: int = 0       # pages that entered the cache
    evicted: int = 0        # pages the pool took back for other rows


class PrefixCache:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._pages: dict[bytes, int] = {}
        self._keys: dict[int, bytes] = {}
        self.stats = CacheStats()
        pool.on_evict = self.evicted

    def __len__(self) -> int:
        """Pages holding a cached prefix, held by rows or not."""
        return len(self._pages)

    def match(self, keys: tuple[bytes, ...] | list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of `keys`, not yet shared."""
        pages: list[int] = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A row was admitted after a lookup: its prompt's length, and how
        much of it the cache held."""
        self.stats.queries += prompt_tokens
        self.stats.hits += cached_tokens

    def insert(self, keys: tuple[bytes, ...] | list[bytes], pages: list[int]) -> None:
        """The step that wrote `pages` (the row's first pages, full) has run:
        they hold the prefix `keys` names. A prefix cached already keeps its
        page (the row's copy is freed with the row)."""
        for key, page in zip(keys, pages):
            if key in self._pages or page in self._keys:
                continue
            self._pages[key] = page
            self._keys[page] = key
            self.pool.keep(page)
            self.stats.inserted += 1

    def evicted(self, page: int) -> None:
        """The pool took `page` for another row: its prefix is gone."""
        key = self._keys.pop(page, None)
        if key is not None:
            del self._pages[key]
            self.stats.evicted += 1
