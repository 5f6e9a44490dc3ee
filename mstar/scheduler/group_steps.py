"""A standing group's step as the scheduler plans it: the group (a decode
loop's rows held as tensors) in, a `StepPlan` out: the window of rows it
runs, the steps its launch may take, a page for each row that needs one (the
youngest growing rows preempted when the pool is dry), and the waiting
prompts that ride in its step (a mixed step). A mixin of `Scheduler`, whose
queues, caps and pools it reads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mstar.scheduler.pages import PagePool
from mstar.scheduler.plan import LaunchSteps, StandingGroup, StepPlan
from mstar.scheduler.work import ModeCaps, QueueKey, WorkItem

# new rows a mixed step takes at most: its CUDA graphs are captured for that many
MIXED_ROWS = 4
# a prompt that would ride in chunks smaller than this (a group leaving little of the step's token cap) takes
# steps of its own instead, or a long prompt would creep a few tokens a step
MIXED_MIN_CHUNK = 64


@dataclass(eq=False, slots=True)
class Standing:
    key: QueueKey
    group: StandingGroup
    offset: int = 0  # where its next window starts, while it holds more rows than a step takes


class GroupSteps:
    """The standing-group side of a `Scheduler`."""

    caps: dict[QueueKey, ModeCaps]
    pools: dict[str, PagePool]
    grow_pages: bool
    steps: LaunchSteps
    mix: dict[str, frozenset[str]]
    mix_tokens: dict[str, int]
    _queues: dict[QueueKey, deque[WorkItem]]
    _since_admit: dict[str, int]

    if TYPE_CHECKING:  # the scheduler's own
        def ticket(self) -> int: ...
        def at_cap(self, component: str) -> bool: ...
        def row_ended(self, component: str) -> None: ...
        def _admission_waits(self, key: QueueKey) -> bool: ...
        def _take(self, key: QueueKey, max_rows: int | None = None, max_tokens: int | None = None,
                  chunks_only: bool = False) -> list[WorkItem]: ...

    def _group_step(self, standing: Standing, in_flight: bool) -> StepPlan:
        key, group = standing.key, standing.group
        max_rows = self.caps[key].max_rows
        pool = self.pools.get(key[0]) if self.grow_pages else None
        most = self.steps.most if self.steps.most > 1 and not group.emits else self.steps.emitted
        steps = group.steps_room(most) if most > 1 and not self._starting(key[0]) else 1
        if pool is None:  # its rows hold every page they need
            group.ticket = self.ticket()
            rows = self._window(standing, len(group), max_rows)
            return StepPlan(key[0], key[1], self._mixed(standing, rows), group=group, rows=rows, steps=steps)
        short = group.short_of_pages(pool.page_size, steps)
        if steps > 1 and len(short) > pool.num_free:  # one step at a time before a settle or a preemption
            steps, short = 1, group.short_of_pages(pool.page_size)
        preempt: list[int] = []
        if len(short) > pool.num_free:
            if in_flight:  # finished rows free pages, and the rest have exact lengths
                return StepPlan(key[0], key[1], [], settle=True)
            preempt = self._victims(key[0], group, short, pool)
        pages = pool.allocate(len(short))
        assert pages is not None  # the victims made room
        group.ticket = self.ticket()
        rows = self._window(standing, len(group) - len(preempt), max_rows)
        # a step that preempts its rows for pages admits no new ones with the pages it freed
        mixed = [] if preempt else self._mixed(standing, rows)
        return StepPlan(key[0], key[1], mixed, group=group, rows=rows, grow=list(zip(short, pages)), preempt=preempt,
                        steps=steps)

    def _starting(self, component: str) -> bool:
        """Rows of `component` wait and could run (start, or take their next
        chunk): a group's launch then runs one step, so that they run after
        it. Rows that only wait for the running cap do not hold it back."""
        full = self.at_cap(component)
        return any(q and (not full or any(not item.starts_row for item in q))
                   for k, q in self._queues.items() if k[0] == component)

    def _mixed(self, standing: Standing, rows: slice) -> list[WorkItem]:
        """The waiting prompts a group step takes in beside its rows: from the
        queue of its component's mixing modes whose head waited longest, the
        chunkable items at its front, within the tokens and rows the step
        leaves (`MIXED_ROWS`)."""
        (component, mode), group = standing.key, standing.group
        modes = self.mix.get(component, frozenset())
        n = rows.stop - rows.start
        if mode not in modes or not n or not group.mixes:
            return []
        room = self.caps[standing.key].max_tokens - n
        room = min(room, self.mix_tokens.get(component, room))
        queues = [(q[0].ticket, k) for k, q in self._queues.items()
                  if k[0] == component and k[1] in modes and k[1] != mode and q and q[0].chunkable]
        if room < 1 or not queues:
            return []
        key = min(queues)[1]
        if self._admission_waits(key) or room < min(MIXED_MIN_CHUNK, self._queues[key][0].remaining):
            return []
        items = self._take(key, min(MIXED_ROWS, self.caps[key].max_rows), room, chunks_only=True)
        if any(i.starts_row for i in items):
            self._since_admit[component] = 0
        return items

    def _victims(self, component: str, group: StandingGroup, short: list[int], pool: PagePool) -> list[int]:
        """Preempt the youngest growing rows (then, were that not enough, the
        youngest others) until the short rows left fit in the free pages;
        `short` loses the victims, and its rows are numbered as after they
        left. The victims' pages go back to the pool now (a page another
        holder shares frees nothing), and each stops being a running row: it
        is admitted again to resume. Highest first."""
        growing = group.growing()
        held = set(growing)
        order = growing[::-1] + [r for r in range(len(group) - 1, -1, -1) if r not in held]
        victims: list[int] = []
        free, needed, shorts = pool.num_free, len(short), set(short)
        for row in order:
            if needed <= free:
                break
            victims.append(row)
            needed -= row in shorts
            free += sum(pool.refcount(p) == 1 for p in group.pages(row))
        for row in victims:
            pool.free(list(group.pages(row)))
            self.row_ended(component)
        gone = set(victims)
        short[:] = [r - sum(v < r for v in victims) for r in short if r not in gone]
        return sorted(victims, reverse=True)

    @staticmethod
    def _window(standing: Standing, n: int, max_rows: int) -> slice:
        """The rows of the group's next step: all `n`, or `max_rows` taken in
        turn, so that every row steps as often when there are more."""
        if n <= max_rows:
            standing.offset = 0
            return slice(0, n)
        start = standing.offset % n
        stop = min(n, start + max_rows)
        standing.offset = 0 if stop == n else stop
        return slice(start, stop)
