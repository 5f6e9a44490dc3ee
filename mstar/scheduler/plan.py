"""What the scheduler hands the worker for one step: a `StepPlan`, the whole
decision (rows admitted with their pages, a group's row window, pages to
grow, rows to preempt), so that the worker only carries it out. And what the
scheduler reads of a standing group to decide it (`StandingGroup`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mstar.scheduler.work import WorkItem


# Several decode steps a launch where the tokens reach clients only through a consumer (a speech stream's codec),
# whose chunks hide the burst: 4 took bench_decode's host work a step at 256 rows to about a third on an H100,
# while 8 would hold a chunk back by up to a chunk's audio at 400 streams (served speech gained nothing there:
# analysis.md, "Several steps a launch for speech alone")
AUTO_STEPS = 4


@dataclass(frozen=True)
class LaunchSteps:
    """Most decode steps a group's launch runs back to back
    (`--num-scheduler-steps`): `most` for a group whose tokens no client
    reads as they come (a speech walk's go to its codec), `emitted` for one
    where some row's walk emits them (its client then gets them a launch at
    a time)."""

    most: int = 1
    emitted: int = 1

    @classmethod
    def of(cls, num_scheduler_steps: int | None, streamed: bool = True) -> LaunchSteps:
        """The flag's value: a number for every group, or None ("auto"):
        `AUTO_STEPS` where no row's tokens are emitted, one step where they
        are; one step everywhere unless some served walk streams a value to
        a consumer without emitting it (`streamed`), so that a model of text
        walks alone keeps none of the bookkeeping several steps need."""
        if num_scheduler_steps is None:
            return cls(AUTO_STEPS, 1) if streamed else cls()
        return cls(num_scheduler_steps, num_scheduler_steps)


class StandingGroup(Protocol):
    """Rows that step together until each stops (the worker's decode
    `LoopGroup`), as the scheduler sees them. Rows are numbered in the order
    they joined, so the last row is the youngest."""

    ticket: int  # its place in line, renewed each time it steps
    mixes: bool  # its steps can take new rows' prompt tokens beside its rows
    emits: bool  # some row's walk sends its tokens to a client as they come

    def __len__(self) -> int: ...

    def short_of_pages(self, page_size: int, ahead: int = 1) -> list[int]:
        """Rows, ascending, whose pages cannot hold the tokens their next
        `ahead` steps write, each once per page it lacks (vectorised over the
        rows)."""
        ...

    def steps_room(self, most: int) -> int:
        """Steps (1 to `most`) its next launch may run back to back."""
        ...

    def pages(self, row: int) -> Sequence[int]:
        """The pages row `row` holds."""
        ...

    def growing(self) -> list[int]:
        """Rows, ascending, that take their pages as they go (the others hold
        every page they may need): the rows preemption takes first."""
        ...


@dataclass(eq=False, slots=True)
class StepPlan:
    """One step of `component.mode`, to be carried out in this order:
    `settle` (read every launched step), `preempt` (swap those group rows
    out), `grow` (hand those pages to those group rows), admit `items` (their
    pages are filled in), resume the preempted among them, run.

    A plan is a step of `items`, or of `group` over `rows` (with `items`:
    new rows whose prompt tokens, `chunk` of them each, ride in the group's
    step, a mixed step). A plan with neither only asks for a settle: the
    worker reads what it launched, then asks again (the scheduler decides on
    exact row state only).

    `preempt` lists the group's youngest growing rows, highest index first;
    the rows in `grow` and `rows` are numbered as after those rows left (a
    row after one that left moves down one). The preempted rows' pages went back
    to the pool when the plan was made: the pages in `grow` may be among
    them, as the device runs the swap copy before the step that writes them.
    """

    component: str
    mode: str
    items: list[WorkItem]
    group: StandingGroup | None = None
    rows: slice | None = None                  # the group's rows this step runs (its max_num_seqs window)
    grow: Sequence[tuple[int, int]] = ()       # (group row, page) to append to the row's pages
    preempt: Sequence[int] = ()                # group rows to swap out, highest first
    settle: bool = False
    steps: int = 1                             # the group's steps to run back to back (`grow` covers them all)

    @property
    def has_work(self) -> bool:
        return bool(self.items) or self.group is not None
