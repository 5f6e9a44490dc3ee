"""Forks of KV rows, on the worker thread: a scheduled `@fork` step's items
in (each a partition at a `ForkRows` instruction, with the pages the
scheduler granted), the branch rows made beside their main row out.

A "share" branch holds main's full pages (one more holder each) and a copy
of its partial last page, in a page the scheduler granted, so no shared page
is ever written; a "fresh" one starts empty.
"""

from __future__ import annotations

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.worker.preemption import Preemption
from mstar.engine.worker.walker import Walker
from mstar.graph import ForkRows
from mstar.scheduler import Batch, Scheduler


def fork_rows(batch: Batch, cache: KVCache, scheduler: Scheduler, walker: Walker,
              preemption: Preemption | None) -> None:
    """Split each item's KV row of `batch.component` into the branches its fork names."""
    pool = scheduler.pools[batch.component]
    for item in batch.items:
        part = item.payload.part
        ins = part.plan.program[part.pc]
        assert isinstance(ins, ForkRows)
        main = part.row(batch.component)
        granted = list(item.granted)
        item.granted = []
        if main.swapped is not None:  # preempted while it waited to fork: its KV comes back first
            assert preemption is not None
            n = main.swapped.num_pages
            main.admit(granted[:n])
            granted = granted[n:]
            preemption.swap_in(main, batch.component)
        full, partial = divmod(main.kv_len, pool.page_size)
        started = 0
        for name, how in ins.fork.branches:
            if how != "share" or not main.pages:
                continue
            pages = main.pages[:full]
            pool.share(pages)
            if partial:
                copy = granted.pop()
                cache.copy_pages([main.pages[full]], [copy])
                pages = [*pages, copy]
            part.row(batch.component, name).fork_from(main, pages)
            started += 1
        scheduler.rows_started(batch.component, started)
        walker.forked(part)
