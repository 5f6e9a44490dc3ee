"""Swapping group rows out and back in (`--kv-reservation lazy`): rows the
scheduler's plan preempts in, their KV in host memory out; preempted rows it
admits again in, their KV in their new pages out.

The scheduler decides which rows and when (`StepPlan.preempt`, the youngest
rows, once every launched step is read). A preempted row's KV pages are
copied to host memory behind the steps that wrote them (the plan gave the
pages back to the pool already), and it waits in its loop's queue for as
many pages, with the ticket of its preemption. On admission its KV is copied
into the new pages and it joins its group again, exactly where it left off
(same tokens, same draw counters), so a preempted request's output is the
same as if it had never been preempted.
"""

from __future__ import annotations

from collections.abc import Sequence

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.worker.loop_group import LoopGroup
from mstar.engine.worker.walker import Walker
from mstar.scheduler import Scheduler, WorkItem


class Preemption:
    def __init__(self, caches: dict[str, KVCache], walker: Walker) -> None:
        self.caches = caches
        self.walker = walker
        self.preempted = 0   # rows swapped out so far
        self.resumed = 0

    def swap_out(self, group: LoopGroup, rows: Sequence[int]) -> None:
        """Take `rows` out of `group`, highest first, and swap their KV out."""
        for i in rows:
            leave = group.evict(i)
            row = leave.part.row(group.component)
            swapped = self.caches[group.component].swap_out(row.pages)
            row.swap_out(swapped)  # its pages are back in the pool since the plan was made
            self.preempted += 1
            self.walker.preempted(leave, swapped)

    def unstick(self, scheduler: Scheduler) -> bool:
        """Nothing can move on and rows wait for pages: swap out the youngest
        queued row that holds pages (a step-by-step row: a talker's, a fork's
        branch), unless it is the only one, so the older ones can go on. Its
        step runs once its pages and KV are back. False: no row to swap."""
        for component, cache in self.caches.items():
            pool = scheduler.pools[component]
            waiting = scheduler.holding(component)
            if len(waiting) < 2:
                continue
            item = waiting[0]
            row = item.payload.part.row(component, item.payload.branch)
            swapped = cache.swap_out(row.pages)
            pool.free(row.pages)
            row.swap_out(swapped)
            scheduler.requeued(item, swapped.num_pages)
            self.preempted += 1
            return True
        return False

    def resume(self, items: list[WorkItem]) -> list[WorkItem]:
        """Bring back the preempted rows among admitted `items` (their pages
        are theirs already): a group's row rejoins its group, any other runs
        its step with the rest of `items`, which are returned."""
        rest = []
        for item in items:
            work = item.payload
            row = work.part.rows.get((item.component, work.branch))
            if row is not None and row.swapped is not None:
                swapped = row.swapped_in()  # into its first pages: any after them are for the step's new tokens
                self.caches[item.component].swap_in(swapped, row.pages[:swapped.num_pages])
                self.resumed += 1
                if work.rejoin:
                    self.walker.resume(work.part)
                    continue
            rest.append(item)
        return rest
