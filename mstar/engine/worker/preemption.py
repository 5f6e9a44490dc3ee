"""Lazy KV pages and preemption (`--kv-reservation lazy`): group rows in,
pages for their next token out; when the pool is dry, the youngest rows are
swapped out to host memory and queued to resume once pages free up.

A row of a decode `LoopGroup` gets a page when the token its next step writes
would not fit. If the pool has none, the worker first reads every launched
step (rows that finish give their pages back, and every row's state is then
exact), then preempts the youngest rows (the last to join) until the short
rows fit: a preempted row's KV pages are copied to host memory behind the
steps that wrote them, its pages go back to the pool, and it waits in its
loop's queue for as many pages, with the ticket of its preemption. The
scheduler admits it like any row; on admission its KV is copied into the new
pages and it joins its group again, exactly where it left off (same tokens,
same draw counters), so a preempted request's output is the same as if it had
never been preempted.
"""

from __future__ import annotations

from typing import Callable

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.worker.loop_group import LoopGroup
from mstar.engine.worker.walker import Walker
from mstar.scheduler import PagePool, WorkItem


class Preemption:
    def __init__(self, pools: dict[str, PagePool], caches: dict[str, KVCache], walker: Walker,
                 settle: Callable[[], None]) -> None:
        """`settle`: reads every launched step of every group (the worker's)."""
        self.pools = pools
        self.caches = caches
        self.walker = walker
        self.settle = settle
        self.preempted = 0   # rows swapped out so far
        self.resumed = 0

    def grow(self, group: LoopGroup) -> None:
        """Give every row of `group` room for the token its next step writes."""
        pool = self.pools[group.component]
        short = group.short_of_pages(pool.page_size)
        settled = False
        while short:
            page = pool.allocate(1)
            if page is not None:
                group.add_page(short.pop(0), page[0])
                continue
            if not settled:
                self.settle()  # finished rows free their pages; the rest have exact state
                settled = True
            else:
                self._swap_out(group, len(group.rows) - 1)  # the youngest row
            short = group.short_of_pages(pool.page_size)

    def _swap_out(self, group: LoopGroup, i: int) -> None:
        leave = group.evict(i)
        part = leave.part
        swapped = self.caches[group.component].swap_out(part.pages)
        self.walker.free_pages(part)
        self.preempted += 1
        self.walker.preempted(leave, swapped)

    def resume(self, items: list[WorkItem]) -> list[WorkItem]:
        """Bring back the preempted rows among admitted `items` (their pages
        are theirs already); the other items, to run as a step."""
        rest = []
        for item in items:
            part = item.payload[0]
            if part.swapped is None:
                rest.append(item)
                continue
            self.caches[item.component].swap_in(part.swapped, part.pages)
            self.resumed += 1
            self.walker.resume(part)
        return rest
