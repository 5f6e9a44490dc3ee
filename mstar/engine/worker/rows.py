"""Per-request execution state on a device worker.

A `RequestRun` is one request's walk on a worker; each of its partitions is a
`PartitionRun` with a cursor into the partition's program (`pc`) and a
`Frame` per loop it is in, the handles of the values it can read, a `KVRow`
per KV component it steps (`kv_rows.py`), and (for a stream consumer) the
`StreamBuffer` it reads. Only the owning worker thread touches these
objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.engine.movement.tensor_store import TensorRef
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.streaming.buffer import StreamBuffer, StreamItem
from mstar.graph import Loop, PartitionPlan, Run, Step, WalkPlan
from mstar.types import SamplingParams

__all__ = ["Frame", "PartitionRun", "RequestRun", "StreamItem", "Work"]


@dataclass(eq=False)
class RequestRun:
    request_id: str
    walk: WalkPlan
    sampling: dict[str, SamplingParams]   # by sampling key (see `PartitionRun.sampling`), each with its seed
    stop_ids: dict[str, tuple[int, ...]]  # by sampling key
    partitions: dict[str, PartitionRun] = field(default_factory=dict)
    live: int = 0
    root_reason: str | None = None
    cut: bool = False  # a loop of it stopped at its token budget: the request ends "length", however its root did
    # input that keeps arriving (WalkPlan.more_input): the pieces not started yet, and whether more may come
    input_open: bool = False
    more: list[dict[str, torch.Tensor]] = field(default_factory=list)  # by walk input name
    more_tokens: list[int] = field(default_factory=list)  # the prompt tokens of each piece in `more`
    places: dict[str, int] = field(default_factory=dict)  # partition -> worker, where not all run here
    started: set[str] = field(default_factory=set)  # consumers on other workers that its streams started
    priority: int = 0  # lower: its waiting steps go first (`WorkItem.priority`)
    takes_turns: bool = False  # submitted with input still to come: it runs a turn per piece
    entering: bool = False  # its Submit is being applied: the rows its steps start now are new (`WorkItem.new_request`)

    @property
    def shared(self) -> bool:
        """Some of its partitions run on other workers."""
        return len(set(self.places.values())) > 1

    def key_of(self, partition: str) -> str:
        """The sampling key a partition draws under: its own where it samples,
        else the root's (a seeded codec's noise draws from the request's seed)."""
        return partition if partition in self.sampling else self.walk.root


@dataclass(eq=False, slots=True)
class Work:
    """What a queued step of a partition carries to the runner: its inputs
    by walk value, and the branch row it steps (after a fork)."""

    part: PartitionRun
    inputs: dict[str, TensorRef | list[StreamItem] | int]
    branch: str = "main"
    rejoin: bool = False  # a preempted decode-group row coming back: it rejoins its group, it runs no step
    banned: tuple[int, ...] = ()  # ids the step may not sample (its loop's stop ids, before `min_tokens`)
    held: dict[str, torch.Tensor] | None = None  # its inputs, taken from the store by its first chunk's step


@dataclass(eq=False, slots=True)
class Frame:
    """A loop a partition is in."""

    loop: int                 # its index in `PartitionPlan.loops`
    cap: int | None           # writes of its value at which it stops ("length"); None: no cap
    count: int = 0            # writes of its value since it started, the write that entered it included
    iteration: int = 0        # rounds of its body finished (`@i`)
    collected: list[TensorRef] = field(default_factory=list)  # what its `Collect` gathered so far
    stops: tuple[int, ...] | None = None  # its stop ids, read at its first check (`stop_rules.frame_stop_ids`)


@dataclass(eq=False, slots=True)
class PartitionRun:
    request: RequestRun
    plan: PartitionPlan
    pc: int = 0                     # the instruction of `plan.program` under the cursor
    loops: list[Frame] = field(default_factory=list)  # the loops it is in, outermost first
    values: dict[str, TensorRef] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)
    busy: bool = False              # an item of this partition is queued or running
    done: bool = False
    rows: dict[tuple[str, str], KVRow] = field(default_factory=dict)  # by (KV component, branch)
    outstanding: int = 0            # branch rows of its step still queued or running
    turn_cap: int | None = None     # a later turn's write cap: what is left of the context
    room_for: int | None = None     # tokens the piece of input queued next needs in the context (`turns.py`)
    answer_room: int = 1            # and the fewest its turn must keep to answer (the model's `min_turn_tokens`)
    kv_ceiling: int | None = None   # its turn's KV holds at most this when its loop ends (`turn_ceiling`)
    awaiting_input: bool = False    # its turn is over and it waits for more input
    turn_token: int | None = None   # the last token of its last turn (not in the cache yet)
    inbox: StreamBuffer | None = None  # a stream consumer's: what it reads
    parked: bool = False            # a consumer waiting for its stream (to start, or for the next chunk)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def turn_ceiling(self, max_model_len: int, kv_len: int | None = None) -> int | None:
        """The KV its turn may hold when its loop ends, leaving the piece of
        input queued next its room (None: none is queued): half of what the
        context has left besides that piece, less where the piece's turn
        would keep fewer than `answer_room` tokens to answer in; fixed the
        first time it is asked, once the turn's prompt is in the KV
        (`kv_len`: the KV as the steps launched leave it; default its row's)."""
        if self.room_for is None:
            return None
        if self.kv_ceiling is None:
            held = self.kv_row().kv_len if kv_len is None else kv_len
            left = max_model_len - held - self.room_for
            self.kv_ceiling = held + max(min(left // 2, left - self.answer_room), 0)
        return self.kv_ceiling

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def sampling(self) -> SamplingParams:
        """The params of the step under the cursor (or of the partition)."""
        return self.request.sampling[self.key()]

    @property
    def seed(self) -> int:
        return self.seed_of(None)

    def seed_of(self, step: Step | None) -> int:
        """The seed `step` (default: the step under the cursor) draws under."""
        seed = self.request.sampling[self.key(step)].seed
        assert seed is not None  # `prepared.resolve_sampling` gives every key one
        return seed

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.request.stop_ids[self.key()]

    def key(self, step: Step | None = None) -> str:
        """The sampling key `step` (default: the step under the cursor) draws
        under: its own, or the partition's."""
        step = step or (ins.step if (ins := self.instr()) is not None else None)
        if step is not None and step.sampling is not None:
            return step.sampling
        return self.request.key_of(self.plan.name)

    def row(self, component: str, branch: str = "main") -> KVRow:
        """Its row of `component`'s KV cache, of `branch` after a fork (empty
        until a step is admitted)."""
        row = self.rows.get((component, branch))
        if row is None:
            row = self.rows[(component, branch)] = KVRow(component, branch=branch)
        return row

    def kv_row(self) -> KVRow:
        """Its one KV row (a root partition taking turns has one)."""
        assert len(self.rows) == 1, f"partition '{self.name}' has {len(self.rows)} KV rows"
        return next(iter(self.rows.values()))

    def instr(self) -> Run | None:
        """The step under the cursor; None past the end (or at a loop mark,
        which the walker never leaves it on)."""
        program = self.plan.program
        ins = program[self.pc] if self.pc < len(program) else None
        return ins if isinstance(ins, Run) else None

    def current_step(self) -> Step:
        ins = self.instr()
        assert ins is not None
        return ins.step

    def frame(self, loop: int) -> Frame | None:
        """The frame of loop `loop`, if the partition is in it."""
        return next((f for f in reversed(self.loops) if f.loop == loop), None)

    def loop(self) -> Loop | None:
        """The innermost loop it is in."""
        return self.plan.loops[self.loops[-1].loop].loop if self.loops else None

    def set_loop_count(self, count: int) -> None:
        """The innermost loop's value was written `count` times in all (a
        decode group counts its rows' writes itself and hands them back)."""
        frame = self.loops[-1]
        value = self.plan.loops[frame.loop].loop.value
        self.writes[value] = self.writes.get(value, 0) + count - frame.count
        frame.count = count
