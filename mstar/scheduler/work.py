"""What the scheduler moves around: work items (one row of a future step),
and the batch of them a step runs. The engine's row state rides along in
`payload`; the scheduler never looks inside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QueueKey = tuple[str, str]  # (component, mode)


@dataclass(frozen=True)
class ModeCaps:
    """Most rows and packed tokens one step of a (component, mode) may take."""

    max_rows: int
    max_tokens: int


@dataclass(eq=False, slots=True)
class WorkItem:
    """One row of a future step of `component.mode`.

    `num_tokens`: tokens the row adds to the step (1 for non-token modes).
    `pages_needed`: KV pages the row must get before it may run; the scheduler
    allocates them all or leaves the item waiting, and puts them in `granted`.
    `starts_row`: running it makes the row one of its component's running
    rows, which are capped (`Scheduler(max_running=...)`). `needs_slot`: the
    row of a component with per-row state has no slot yet; it gets one with
    its pages, or neither (`granted_slot`). `prefix`: where the component
    has a prefix cache, the pages of a cached prefix are granted first
    (shared), as many as leave the step at least one token to compute.
    `chunkable`: a step computes as many of its tokens as the step's token
    cap leaves room for (`chunk`); the rest wait in line for later steps.
    `new_request`: it starts the row of a request just submitted (queued as
    its Submit was applied), the only kind of row a burst of arrivals holds
    (`Scheduler.held`); a row that starts later in a running request (a
    talker's first, one preempted and coming back, a rejoining branch) does not
    wait for other requests' arrivals. `first_step`: queued as its request's
    Submit was applied, of any component (a media encoder's too): the step
    that runs it ends the request's queue time (`StepReport.started`).
    `leads`: a step on the first chunk of a stream's turn (a listener's first
    audio waits on it, not only on the producer's steps): it goes to the front
    of its queue, and that queue ahead of the line (`Scheduler._next`).
    """

    request_id: str
    partition: str
    component: str
    mode: str
    num_tokens: int = 1
    pages_needed: int = 0
    payload: Any = None
    starts_row: bool = False   # the row's first KV step (or its resume): it becomes a running row
    ticket: int = -1
    granted: list[int] = field(default_factory=list)
    needs_slot: bool = False
    granted_slot: int | None = None
    capped: bool = True        # a row that starts counts against the running cap (not a forked branch's)
    prefix: tuple[bytes, ...] = ()  # a starting row's prompt: the keys of its full pages (`prefix_cache.page_keys`)
    cached_tokens: int = 0     # admitted with its first tokens' KV from the prefix cache (until the row takes it)
    chunkable: bool = False    # its tokens may be computed over several steps
    done: int = 0              # of its tokens, those already in its row's KV (cached, or earlier chunks)
    chunk: int = 0             # tokens its next step computes (a chunkable item's, set as it is taken)
    priority: int = 0          # lower goes first in its queue (its request's priority)
    passed: bool = False       # an item of better priority took its place in line (once: see `Scheduler._insert`)
    new_request: bool = False  # a just-submitted request's first step (cleared once its row started)
    first_step: bool = False   # queued as its request's Submit was applied, of any component (cleared once it ran)
    leads: bool = False        # a step on a stream turn's first chunk: ahead of the line

    @property
    def key(self) -> QueueKey:
        return (self.component, self.mode)

    @property
    def remaining(self) -> int:
        """Tokens still to compute."""
        return self.num_tokens - self.done

    @property
    def partial(self) -> bool:
        """Its next step leaves tokens for later ones."""
        return self.chunkable and 0 < self.chunk < self.remaining


@dataclass(eq=False)
class Batch:
    """The rows one step of `component.mode` runs, in FIFO order."""

    component: str
    mode: str
    items: list[WorkItem]

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def __len__(self) -> int:
        return len(self.items)
