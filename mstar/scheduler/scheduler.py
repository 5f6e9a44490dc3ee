"""The scheduler of one device: ready queues per (component, mode), batch
building under per-mode caps, FIFO fairness, and KV page admission.

Work items come in (`add`), batches go out (`schedule`). The queue served next
is the one whose oldest item has waited longest, so prefills of new requests
and decode steps of running ones take turns in arrival order; a queue headed
by a step on a stream's first chunk (`WorkItem.leads`: a codec's first window,
whose audio a listener waits for) goes before them all, unless the step in
flight cuts more chunks for it (`_leads`). Within a queue,
an item of a better (lower) priority goes ahead of the others (`_insert`),
and items are taken in order until a cap is reached or an item cannot get its
pages; an item that cannot get pages waits at the head of its queue (nothing
behind it in that queue jumps ahead, so large requests are not starved). A KV
component has at most `max_running` running rows (rows holding pages): an
item that would start one more waits the same way, so under overload new
requests queue instead of slowing every running stream down. A row that
starts with a prompt whose first pages are in its component's prefix cache
gets them shared (`prefix_cache.py`) and only the pages after them fresh.
A prompt longer than a step's token cap (or than the room other rows leave)
runs in chunks: each step computes what fits, and the rest goes to the back
of the line (`next_chunk`), so running rows step between its chunks.

A standing group (rows that step together until each stops, like a decode
loop held as tensors) takes part in the same order as one queue: it holds a
ticket, renewed each time it steps, and is scheduled when its ticket is the
oldest. The scheduler decides its whole step (`StepPlan`, `group_steps.py`): the window of at
most `max_rows` rows it runs, taken in turn when it holds more, and, when
its rows get pages as they grow (`grow_pages`), a page for each row that
needs one, making room by preempting the youngest rows that take their pages
as they go (`StandingGroup.growing`) when the pool is dry.
It decides that on exact row state only: with steps of the worker still
unread, it first asks the worker to read them (`StepPlan.settle`). A group
whose rows may share their step with new rows' prompts (`mix`) takes the
waiting prompts of its component into its step, as many tokens as the step's
token cap leaves beside its rows (a mixed step): new requests then start
without a step of their own, and the running rows keep their cadence.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from mstar.scheduler.group_steps import GroupSteps, Standing
from mstar.scheduler.pages import PagePool
from mstar.scheduler.plan import LaunchSteps, StandingGroup, StepPlan
from mstar.scheduler.prefix_cache import PrefixCache, page_keys, shared_tokens, usable_pages
from mstar.scheduler.work import ModeCaps, QueueKey, WorkItem

# a prompt that starts as one this step computes waits a step to take those pages from the cache only when they
# hold this many tokens or more: a shorter shared start (a short prompt sent twice) is computed again in the one
# step, for less than the extra step its wait would cost (17-27 ms beside 59 rows on an H100, for 40 tokens)
SHARE_MIN_TOKENS = 64


class Scheduler(GroupSteps):
    def __init__(self, caps: dict[QueueKey, ModeCaps], pools: dict[str, PagePool] | None = None,
                 max_running: dict[str, int] | None = None, grow_pages: bool = False,
                 slots: dict[str, PagePool] | None = None, prefix_caching: bool = False,
                 admit_every: int = 0, mix: dict[str, frozenset[str]] | None = None,
                 mix_tokens: dict[str, int] | None = None, steps: LaunchSteps = LaunchSteps()) -> None:
        """`grow_pages`: a standing group's rows get their pages one at a
        time, as they need them, instead of holding them from admission.
        `slots`: per component with per-row state, its free slots (pages of
        one slot). `prefix_caching`: a prefix cache over each page pool.
        `admit_every`: while a component's standing groups have rows, a step
        that starts new rows of it waits until they have stepped this many
        times since the last one (new requests then share fewer, larger
        prefill steps; 0: no wait). `mix`: per component, the modes whose
        rows may share one step: a standing group of one of them takes the
        waiting prompts of the others into its steps; `mix_tokens`: per
        component, most prompt tokens one such step takes (a longer prompt
        rides in chunks: past its graphs' largest bucket a mixed step runs
        eagerly, holding the group's rows that long). `steps`: most decode
        steps a group's launch runs back to back (by whether it emits its
        tokens), while no new row of its component waits to start."""
        self.admit_every = admit_every
        self.steps = steps
        self.held = False  # an idle component's new requests' rows wait (the worker's `BurstGate`: a burst is arriving)
        self.burst_from = 0  # the first ticket of the open burst's rows: older items are never held
        self.held_back = False  # the last plan held a queue back (so an empty plan is not a stuck pool)
        self.mix = dict(mix or {})
        self.mix_tokens = dict(mix_tokens or {})
        self._since_admit: dict[str, int] = {}  # group steps per component since a step started rows
        # whether reading the group step in flight will queue another consumer step beside an item (a chunk it
        # cuts wakes a parked consumer onto the item's queue): the walker's streams say (`Streams.cuts_next`)
        self.cuts_next: Callable[[WorkItem], bool] = lambda item: False
        self.caps = dict(caps)
        self.pools = dict(pools or {})
        self.caches = {name: PrefixCache(pool) for name, pool in self.pools.items()} if prefix_caching else {}
        self.slots = dict(slots or {})
        self.max_running = dict(max_running or {})
        self.grow_pages = grow_pages
        self.running: dict[str, int] = dict.fromkeys(self.pools, 0)  # rows holding pages, per KV component
        self._queues: dict[QueueKey, deque[WorkItem]] = {k: deque() for k in self.caps}
        self._groups: list[Standing] = []
        self._to_start = 0  # `num_to_start`: published by each plan
        self._tickets = itertools.count()

    def ticket(self) -> int:
        """The next ticket: a place at the back of the line."""
        return next(self._tickets)

    def add_group(self, key: QueueKey, group: StandingGroup) -> None:
        """Schedule `group` (any object with a `ticket` and a length) for
        (component, mode) whenever it is non-empty and its turn has come."""
        if key not in self.caps:
            raise KeyError(f"no queue for {key[0]}.{key[1]} on this device")
        self._groups.append(Standing(key, group))

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
        self._insert(q, item)
        self._to_start += item.starts_row

    @staticmethod
    def _insert(q: deque[WorkItem], item: WorkItem, lend: bool = True) -> None:
        """Put `item` behind the items of its priority or better. A new item
        that passes others takes the ticket of the first it passes, so the
        queue keeps its place in line and the item goes where that one would
        have; each item lends its place once (and a prompt's next chunk takes
        none, `lend=False`), or a stream of better-priority arrivals, or of a
        long prompt's chunks, would keep its queue ahead of running groups.
        A leading item (`WorkItem.leads`) goes in front of all but the
        queue's leading items of its priority or better, and takes the ticket
        of the first it passes."""
        if item.leads:  # behind the queue's leading items of its priority or better only
            at = 0
            while at < len(q) and q[at].leads and q[at].priority <= item.priority:
                at += 1
            if at < len(q):  # the queue keeps its place in line, should it not lead
                item.ticket = min(item.ticket, q[at].ticket)
            q.insert(at, item)
            return
        if not q or q[-1].priority <= item.priority:
            q.append(item)
            return
        at = len(q)
        while at > 0 and q[at - 1].priority > item.priority and not q[at - 1].leads:
            at -= 1
        if at == len(q):  # only leading items are worse: they keep the front
            q.append(item)
            return
        if lend and not q[at].passed:
            q[at].passed = True
            item.ticket = min(item.ticket, q[at].ticket)
        q.insert(at, item)

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
        self._to_start -= sum(item.starts_row for item in removed)
        return removed

    def rows_started(self, component: str, n: int) -> None:
        """`n` rows of `component` began holding pages outside admission (the
        branches a fork gave main's pages to)."""
        self.running[component] = self.running.get(component, 0) + n

    def row_ended(self, component: str) -> None:
        """A running row of `component` gave its pages back (finished, or preempted)."""
        self.running[component] -= 1

    # ------------------------------------------------------------ batching

    def starting(self) -> set[str]:
        """The requests with a queued item that starts a row (admitted yet
        to be, or preempted and waiting to come back)."""
        return {item.request_id for q in self._queues.values() for item in q if item.starts_row}

    def has_work(self) -> bool:
        return any(self._queues.values()) or any(len(g.group) for g in self._groups)

    def holding(self, component: str) -> list[WorkItem]:
        """Queued items of `component` whose rows hold pages already (they
        started), youngest first: what may be swapped out when nothing can
        move on."""
        items = [i for (c, _), q in self._queues.items() if c == component for i in q
                 if not i.starts_row and i.component in self.pools]
        return sorted(items, key=lambda i: i.ticket, reverse=True)

    def waiting(self, component: str) -> list[WorkItem]:
        """Queued items of `component` that wait for pages or a state slot,
        oldest first."""
        items = [i for (c, _), q in self._queues.items() if c == component for i in q
                 if i.pages_needed or i.needs_slot]
        return sorted(items, key=lambda i: i.ticket)

    def requeued(self, item: WorkItem, pages: int, slot: bool = False) -> None:
        """`item`'s row gave its `pages` (and with `slot`, its state slot)
        back (swapped out): it is admitted again as a row that starts, with
        them and what it needed besides."""
        item.pages_needed += pages
        item.needs_slot = item.needs_slot or slot
        item.starts_row, item.new_request, item.first_step = True, False, False  # it ran already: no burst holds it
        item.capped = False  # the running cap holds back new rows, not returning ones
        self.running[item.component] -= 1

    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values()) + sum(len(g.group) for g in self._groups)

    def num_to_start(self) -> int:
        """Rows waiting to start: new KV rows' first steps (and preempted rows
        coming back) not admitted yet, as vLLM's waiting requests: counted as
        rows are queued and taken out, and again by each plan. /metrics reads
        it on the event loop: a count of the queues there would race the
        worker's plan, which takes rows out while it weighs them."""
        return self._to_start

    def schedule(self, in_flight: bool = False) -> StepPlan | None:
        """The next step, or None when no queue can make progress.
        `in_flight`: steps the worker launched are not read yet, so a
        group's row state (lengths, who is still running) may change once
        they are."""
        plan = self._next(in_flight)
        # only a KV component's rows start (hold pages): a codec's queue of windows is not walked each step
        self._to_start = sum(item.starts_row for (component, _), q in self._queues.items() if component in self.pools
                             for item in q)
        return plan

    def opened_burst(self) -> None:
        """A burst of arrivals opened: the rows queued from now on are its own."""
        self.burst_from = self.ticket()

    def _next(self, in_flight: bool) -> StepPlan | None:
        self.held_back = False
        order: list[tuple[bool, int, int, QueueKey, Standing | None]] = [
            (not self._leads(q, in_flight), q[0].ticket, 0, key, None) for key, q in self._queues.items() if q]
        order += [(True, g.group.ticket, 1, g.key, g) for g in self._groups if len(g.group)]
        order.sort(key=lambda entry: entry[:3])
        for _, _, _, key, standing in order:
            if standing is not None:
                self._since_admit[key[0]] = self._since_admit.get(key[0], self.admit_every) + 1
                return self._group_step(standing, in_flight)
            if self._admission_waits(key):
                continue
            items = self._take(key)
            if any(i.starts_row for i in items):
                self._since_admit[key[0]] = 0
            if items:
                # a KV step changes pages and groups that launched steps read
                return StepPlan(key[0], key[1], items, settle=key[0] in self.pools)
        return None

    def _leads(self, q: deque[WorkItem], in_flight: bool) -> bool:
        """Whether queue `q` goes ahead of the line: headed by a step on a
        stream's first chunk, which came out of a step just read (after the
        producer's next step, a listener's first audio would come a step
        later), while the step in flight cuts no chunk for it. In line, the
        queue would run after that step's read, with the chunks it cuts;
        ahead of it, those would take a step of their own (beside many
        streams in many phases, a codec step after every decode step instead
        of every other, each with its fixed cost). So it leads only where
        it runs the same steps as in line, sooner. With no step in flight,
        none is cut meanwhile."""
        return q[0].leads and not (in_flight and self.cuts_next(q[0]))

    def _admission_waits(self, key: QueueKey) -> bool:
        """Whether `key`'s queue, headed by a row that would start, waits: on
        an idle component, for the rest of a burst (`held`); beside running
        groups, for them to step (`admit_every`). Running groups take new
        rows into their own steps (mixed), so a burst is not held there."""
        q = self._queues[key]
        if not q[0].starts_row:
            return False
        if not any(len(g.group) for g in self._groups if g.key[0] == key[0]):
            # only a queue of the burst's new requests waits: one with older rows, a prompt's next chunk, or a
            # running request's row (a talker's first, a preempted one), goes
            held = self.held and all(i.new_request and i.ticket >= self.burst_from for i in q)
            self.held_back |= held
            return held
        return self.admit_every > 0 and self._since_admit.get(key[0], self.admit_every) < self.admit_every

    def _take(self, key: QueueKey, max_rows: int | None = None, max_tokens: int | None = None,
              chunks_only: bool = False) -> list[WorkItem]:
        """Items of `key`'s queue for one step, within its caps (or the given
        ones); `chunks_only`: only chunkable items, up to the first other."""
        q = self._queues[key]
        caps = self.caps[key]
        max_rows = caps.max_rows if max_rows is None else max_rows
        max_tokens = caps.max_tokens if max_tokens is None else max_tokens
        pool = self.pools.get(key[0])
        taken: list[WorkItem] = []
        held: deque[WorkItem] = deque()  # rows waiting for the running cap or a slot; rows running already pass them
        tokens = 0
        limit = self.max_running.get(key[0])
        short = False   # a row that starts waits for pages: rows that start behind it wait too
        computing: set[bytes] = set()  # full pages of the prompts this step computes, uncached
        while q and len(taken) < max_rows:
            item = q[0]
            if chunks_only and not item.chunkable:
                break
            full = tokens + item.remaining > max_tokens
            if full and not (item.chunkable and tokens < max_tokens) and (taken or chunks_only):
                break
            if short and item.starts_row:
                held.append(q.popleft())
                continue
            # the full pages it could take from the cache and would compute now (counted before it gets pages)
            start = () if self._uncached_first_page(item, pool) is None else item.prefix[:usable_pages(
                item, pool.page_size)]
            if start and shared_tokens(start, computing, pool.page_size) >= SHARE_MIN_TOKENS:
                # a prompt this step computes starts the same way (a request's n samples, a shared system
                # prompt arriving at once): a step later its pages are in the cache, not computed twice
                held.append(q.popleft())
                continue
            if item.starts_row and item.capped and limit is not None and self.running.get(key[0], 0) >= limit:
                held.append(q.popleft())
                continue
            slot = None
            if item.needs_slot:  # a slot and the pages, or neither
                slot = self.slots[key[0]].allocate(1)
                if slot is None:  # rows that hold slots pass it: only they can give one back
                    held.append(q.popleft())
                    continue
            if item.pages_needed:
                assert pool is not None
                pages = self._admit_pages(item, pool)
                if pages is None:
                    if slot is not None:
                        self.slots[key[0]].free(slot)
                    if not item.starts_row:
                        break
                    # rows that hold their pages (a prompt's next chunk) pass it: they free pages as they end,
                    # and while they wait nothing may, as running rows preempt one another for pages
                    short = True
                    held.append(q.popleft())
                    continue
                item.granted = pages
                item.pages_needed = 0
            if slot is not None:
                item.granted_slot, item.needs_slot = slot[0], False
            q.popleft()
            if item.starts_row:
                self.running[key[0]] = self.running.get(key[0], 0) + 1
            taken.append(item)
            if item.chunkable:  # as much as the cap leaves room for (a cached prefix counts for nothing)
                item.chunk = min(item.remaining, max(max_tokens - tokens, 1))
            # its pages enter the cache once this step ran (a chunk fills the step's budget)
            computing.update(start)
            tokens += item.chunk if item.chunkable else item.num_tokens
        q.extendleft(reversed(held))  # they keep their places at the front
        return taken

    def _uncached_first_page(self, item: WorkItem, pool: PagePool | None) -> bytes | None:
        """The key of the first page a starting row would look up in its
        component's prefix cache and not find there now (None: no lookup,
        or a hit)."""
        cache = self.caches.get(item.component)
        if cache is None or pool is None or not item.prefix or not item.starts_row or item.done:
            return None
        if usable_pages(item, pool.page_size) < 1:
            return None  # not a full page it could take from the cache
        return None if cache.match(item.prefix[:1]) else item.prefix[0]

    def _admit_pages(self, item: WorkItem, pool: PagePool) -> list[int] | None:
        """The pages `item` needs, a cached prefix's first (shared; at least
        one token is left to compute, for the step's logits), or None."""
        cache = self.caches.get(item.component)
        hit: list[int] = []
        looks_up = cache is not None and item.prefix and item.starts_row and item.done == 0
        if looks_up:
            usable = usable_pages(item, pool.page_size)
            hit = cache.match(item.prefix[:usable])
            pool.share(hit)  # held before the allocation below may take unheld cached pages
        fresh = pool.allocate(item.pages_needed - len(hit))
        if fresh is None:
            pool.free(hit)
            return None
        if looks_up:
            item.cached_tokens = item.done = len(hit) * pool.page_size
            cache.admitted(item.num_tokens, item.cached_tokens)
        return hit + fresh

    def next_chunk(self, item: WorkItem) -> None:
        """`item`'s step computed a chunk of its tokens: the rest wait at the
        back of the line, behind the steps of running rows."""
        item.done += item.chunk
        item.chunk = 0
        # nor do its later chunks lead: a long prompt would otherwise keep its queue ahead of the running groups
        item.starts_row = item.new_request = item.first_step = item.leads = False
        item.ticket = next(self._tickets)
        self._insert(self._queues[item.key], item, lend=False)

    def cache_pages(self, component: str, ids: list[int], pages: list[int]) -> None:
        """A row that ends held `ids` from position 0 in its full `pages`
        (its prompt and what it generated): for rows that start the same way."""
        cache = self.caches.get(component)
        if cache is not None and pages:
            cache.insert(page_keys(ids, cache.pool.page_size, salt=component.encode()), pages)

    def cache_prefix(self, item: WorkItem, pages: list[int]) -> None:
        """`item`'s step has run: its row's first `pages` hold its prompt's
        full pages, for rows that start the same way."""
        cache = self.caches.get(item.component)
        if cache is not None and item.prefix:
            cache.insert(item.prefix, pages[:len(item.prefix)])

    def at_cap(self, component: str) -> bool:
        """`component` runs as many rows as it may: a new one waits."""
        return self.running.get(component, 0) >= self.max_running.get(component, 1 << 62)
