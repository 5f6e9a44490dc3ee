"""The scheduler of one device: ready queues per (component, mode), batch
building under per-mode caps, FIFO fairness, and KV page admission.

Work items come in (`add`), batches go out (`schedule`). The queue served next
is the one whose oldest item has waited longest, so prefills of new requests
and decode steps of running ones take turns in arrival order. Within a queue,
items are taken in FIFO order until a cap is reached or an item cannot get its
pages; an item that cannot get pages waits at the head of its queue (nothing
behind it in that queue jumps ahead, so large requests are not starved). A KV
component has at most `max_running` running rows (rows holding pages): an
item that would start one more waits the same way, so under overload new
requests queue instead of slowing every running stream down.

A standing group (rows that step together until each stops, like a decode
loop held as tensors) takes part in the same order as one queue: it holds a
ticket, renewed each time it steps, and is scheduled when its ticket is the
oldest.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Protocol

from mstar.scheduler.pages import PagePool
from mstar.scheduler.work import Batch, ModeCaps, QueueKey, WorkItem


class StandingGroup(Protocol):
    ticket: int

    def __len__(self) -> int: ...


class Scheduler:
    def __init__(self, caps: dict[QueueKey, ModeCaps], pools: dict[str, PagePool] | None = None,
                 max_running: dict[str, int] | None = None) -> None:
        self.caps = dict(caps)
        self.pools = dict(pools or {})
        self.max_running = dict(max_running or {})
        self.running: dict[str, int] = dict.fromkeys(self.pools, 0)  # rows holding pages, per KV component
        self._queues: dict[QueueKey, deque[WorkItem]] = {k: deque() for k in self.caps}
        self._groups: list[tuple[QueueKey, StandingGroup]] = []
        self._tickets = itertools.count()

    def ticket(self) -> int:
        """The next ticket: a place at the back of the line."""
        return next(self._tickets)

    def add_group(self, key: QueueKey, group: StandingGroup) -> None:
        """Schedule `group` (any object with a `ticket` and a length) for
        (component, mode) whenever it is non-empty and its turn has come."""
        if key not in self.caps:
            raise KeyError(f"no queue for {key[0]}.{key[1]} on this device")
        self._groups.append((key, group))

    # ------------------------------------------------------------- intake

    def add(self, item: WorkItem) -> None:
        """Queue an item at the back of its (component, mode) queue."""
        q = self._queues.get(item.key)
        if q is None:
            raise KeyError(f"no queue for {item.component}.{item.mode} on this device")
        if item.pages_needed:
            pool = self.pools.get(item.component)
            if pool is None:
                raise KeyError(f"component '{item.component}' has no page pool here")
            if item.pages_needed > pool.num_pages:
                raise ValueError(f"a row needs {item.pages_needed} pages; the pool has {pool.num_pages}")
        item.ticket = next(self._tickets)
        q.append(item)

    def remove(self, request_id: str, partition: str | None = None) -> list[WorkItem]:
        """Take out the queued items of a request (of one partition, or all)."""
        removed: list[WorkItem] = []
        for key, q in self._queues.items():
            if not q:
                continue
            keep = deque()
            for item in q:
                hit = item.request_id == request_id and (partition is None or item.partition == partition)
                (removed if hit else keep).append(item)
            if len(keep) != len(q):
                self._queues[key] = keep
        return removed

    def row_ended(self, component: str) -> None:
        """A running row of `component` gave its pages back (finished, or preempted)."""
        self.running[component] -= 1

    # ------------------------------------------------------------ batching

    def has_work(self) -> bool:
        return any(self._queues.values()) or any(len(g) for _, g in self._groups)

    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values()) + sum(len(g) for _, g in self._groups)

    def schedule(self) -> Batch | None:
        """The next batch, or None when no queue can make progress."""
        order: list[tuple[int, int, QueueKey, StandingGroup | None]] = [
            (q[0].ticket, 0, key, None) for key, q in self._queues.items() if q]
        order += [(g.ticket, 1, key, g) for key, g in self._groups if len(g)]
        order.sort(key=lambda entry: (entry[0], entry[1]))
        for _, _, key, group in order:
            if group is not None:
                group.ticket = self.ticket()
                return Batch(key[0], key[1], [], group=group)
            items = self._take(key)
            if items:
                return Batch(key[0], key[1], items)
        return None

    def _take(self, key: QueueKey) -> list[WorkItem]:
        q = self._queues[key]
        caps = self.caps[key]
        pool = self.pools.get(key[0])
        taken: list[WorkItem] = []
        tokens = 0
        while q and len(taken) < caps.max_rows:
            item = q[0]
            if taken and tokens + item.num_tokens > caps.max_tokens:
                break
            limit = self.max_running.get(key[0])
            if item.starts_row and limit is not None and self.running.get(key[0], 0) >= limit:
                break
            if item.pages_needed:
                assert pool is not None
                pages = pool.allocate(item.pages_needed)
                if pages is None:
                    break
                item.pages = pages
                item.pages_needed = 0
            q.popleft()
            if item.starts_row:
                self.running[key[0]] = self.running.get(key[0], 0) + 1
            taken.append(item)
            tokens += item.num_tokens
        return taken
