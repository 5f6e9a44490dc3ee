"""Swapping rows out and back in (`--kv-reservation` lazy or auto): rows the
scheduler's plan preempts in, their KV (and per-row state) in host memory
out; preempted rows it admits again in, their KV in their new pages and
their state in their new slot out.

The scheduler decides which rows and when (`StepPlan.preempt`, the youngest
rows, once every launched step is read). A preempted row's KV pages are
copied to host memory behind the steps that wrote them (the plan gave the
pages back to the pool already), and it waits in its loop's queue for as
many pages, with the ticket of its preemption. On admission its KV is copied
into the new pages and it joins its group again, exactly where it left off
(same tokens, same draw counters), so a preempted request's output is the
same as if it had never been preempted. A row of a component with per-row
state gives its slot back too (state copied out behind the same steps), and
is admitted again with a slot as well as pages.
"""

from __future__ import annotations

from collections import Counter

from collections.abc import Iterator, Sequence

from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.memory.state_slots import StatePool
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.worker.walker import Walker
from mstar.scheduler import PagePool, Scheduler, WorkItem


class Preemption:
    def __init__(self, caches: dict[str, KVCache], walker: Walker, states: dict[str, StatePool] | None = None,
                 slots: dict[str, PagePool] | None = None) -> None:
        """`states` and `slots`: per component with per-row state, its slots'
        tensors and which of them are free."""
        self.caches = caches
        self.walker = walker
        self.states = dict(states or {})
        self.slots = dict(slots or {})
        self.preempted = 0   # rows swapped out so far
        self.preempted_by: Counter[str] = Counter()  # ... by component
        self.resumed = 0

    def clear(self) -> None:
        """Let go of the KV caches and state slots: the worker is shutting
        down, and gives their memory back though it may live on a while."""
        self.caches.clear()
        self.states.clear()

    def swap_out(self, group: LoopGroup, rows: Sequence[int]) -> None:
        """Take `rows` out of `group`, highest first, and swap their KV out
        (their pages are back in the pool since the plan was made)."""
        for i in rows:
            leave = group.evict(i)
            row = leave.part.row(group.component)
            pages, had_slot = self._swap(row, group.component)
            self.preempted += 1
            self.preempted_by[group.component] += 1
            self.walker.preempted(leave, pages, had_slot)

    def _swap(self, row: KVRow, component: str) -> tuple[int, bool]:
        """Copy `row`'s KV (and state) to host memory and free its slot: how
        many pages it gave back, and whether it gave a slot back."""
        swapped = self.caches[component].swap_out(row.pages)
        slot = row.slot
        if slot is None:
            row.swap_out(swapped)
            return swapped.num_pages, False
        row.swap_out(swapped, self.states[component].swap_out(slot))
        self.slots[component].free([slot])
        return swapped.num_pages, True

    def unstick(self, scheduler: Scheduler) -> bool:
        """Nothing can move on and rows wait for pages: swap out one row that
        holds pages outside a decode group (a step-by-step row: a talker's, a
        fork's branch, queued or waiting for its sibling branches): of the
        youngest request other than the one the oldest waiting row belongs
        to, so the older ones can go on; else an idle row (no step queued) of
        that oldest request itself, which then goes on a row at a time; else
        the youngest queued row holding pages, unless it is the only one. Its
        step runs once its pages and KV are back. False: no row to swap."""
        for component in self.caches:
            waiting = scheduler.waiting(component)
            if not waiting:
                continue
            holding = scheduler.holding(component)
            queued = {(id(i.payload.part), i.payload.branch): i for i in holding}
            for part, branch in self._holders(component, waiting[0].request_id, queued):
                self._swap_waiting(scheduler, component, part.row(component, branch),
                                   queued.get((id(part), branch)))
                return True
            swappable = [i for i in holding if _swappable(i.payload.part.row(component, i.payload.branch), i)]
            if len(holding) > 1 and swappable:
                item = swappable[0]
                self._swap_waiting(scheduler, component, item.payload.part.row(component, item.payload.branch), item)
                return True
        return False

    def _holders(self, component: str, oldest: str,
                 queued: dict[tuple[int, str], WorkItem]) -> Iterator[tuple[PartitionRun, str]]:
        """(partition, branch) of the rows of `component` holding pages
        outside decode groups: every one of the other requests, youngest
        first, then the idle ones of request `oldest`."""
        grouped = {id(part) for group in self.walker.groups.values() for part in group.rows}
        runs = [run for run in reversed(tuple(self.walker.runs.values())) if run.request_id != oldest]
        if oldest in self.walker.runs:
            runs.append(self.walker.runs[oldest])
        for run in runs:
            for part in run.partitions.values():
                if id(part) in grouped:
                    continue
                for (c, branch), row in part.rows.items():
                    if c != component or not row.pages or row.swapped is not None:
                        continue
                    item = queued.get((id(part), branch))
                    if _swappable(row, item) and (run.request_id != oldest or item is None):
                        yield part, branch

    def _swap_waiting(self, scheduler: Scheduler, component: str, row: KVRow, item: WorkItem | None) -> None:
        """Swap out `row`, a running row outside a group; `item`: its queued
        step, which now waits for the pages (and slot) it gave back. A row
        with no step queued asks for them with its next step."""
        scheduler.pools[component].free(row.pages)
        pages, slot = self._swap(row, component)
        if item is not None:
            scheduler.requeued(item, pages, slot)
        else:
            scheduler.row_ended(component)
        self.preempted += 1
        self.preempted_by[component] += 1

    def resume(self, items: list[WorkItem]) -> list[WorkItem]:
        """Bring back the preempted rows among admitted `items` (their pages
        are theirs already): a group's row rejoins its group, any other runs
        its step with the rest of `items`, which are returned."""
        rest = []
        for item in items:
            work = item.payload
            row = work.part.rows.get((item.component, work.branch))
            if row is not None and row.swapped is not None:
                self.swap_in(row, item.component)
                if work.rejoin:
                    self.walker.resume(work.part)
                    continue
            rest.append(item)
        return rest

    def swap_in(self, row: KVRow, component: str) -> None:
        """`row`'s KV back into its first pages (any after them are for its
        step's new tokens), its state into the slot it was admitted with."""
        swapped, state = row.swapped_in()
        self.caches[component].swap_in(swapped, row.pages[:swapped.num_pages])
        if state is not None:  # the slot was zeroed when granted: the state goes on
            assert row.slot is not None
            self.states[component].swap_in(state, row.slot)
        self.resumed += 1


def _swappable(row: KVRow, item: WorkItem | None) -> bool:
    """Whether `unstick` may swap `row` out: it takes its pages as it goes, or
    its queued step `item` asks for more. A row holding every page it will
    need (reserved) is never swapped."""
    return row.grows or (item is not None and item.pages_needed > 0)
