"""The cursor of a partition's program (`graph/program.py`): where the
walker's partitions stand and the loops they are in.

`settle` moves a cursor over loop marks to its next step (`Enter` starts a
loop's frame, `Back` goes round again); `move` moves it forward, starting
the fan-outs it passes; `exit` leaves a loop whose stop rule held, writing
what it collected; `write` records a value a step wrote: counted by the
loops it is in, gathered by their collections, fed to the streams it
sources. Only the worker thread touches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.engine.movement.tensor_store import TensorRef
from mstar.engine.worker.rows import Frame, PartitionRun
from mstar.engine.worker.stop_rules import write_cap
from mstar.graph import Back, Collect, Enter, StreamDone

if TYPE_CHECKING:
    from mstar.engine.worker.walker import Walker


class Cursor:
    def __init__(self, walker: Walker) -> None:
        self.walker = walker
        self.store = walker.store

    def settle(self, part: PartitionRun) -> None:
        """Move the cursor over loop marks to the next step: `Enter` starts a
        loop, `Back` goes round again."""
        program = part.plan.program
        while part.pc < len(program) and isinstance(program[part.pc], (Enter, Back)):
            ins = program[part.pc]
            if isinstance(ins, Enter):
                self.push(part, ins.loop)
                cap = part.loops[-1].cap
                if cap is not None and cap <= 0:  # no round to run (a request asking for 0 steps)
                    self.exit(part, ins.loop)
                    continue
                self.move(part, part.pc + 1)
            else:
                assert isinstance(ins, Back) and part.loops[-1].loop == ins.loop
                part.loops[-1].iteration += 1
                part.pc = part.plan.loops[ins.loop].body

    def move(self, part: PartitionRun, pc: int) -> None:
        """Move the cursor forward to `pc`, starting the fan-outs it passes."""
        before, part.pc = part.pc, pc
        for at in range(before + 1, pc + 1):
            self.walker.fork(part, at)

    def push(self, part: PartitionRun, loop: int) -> None:
        """Start loop `loop`: its cap is fixed now, and its collection starts
        with the values its `Collect` puts first."""
        spec = part.plan.loops[loop].loop

        def read(value: str) -> int:
            return int(self.store.get(part.values[value]).reshape(-1)[0])

        frame = Frame(loop, write_cap(part, spec, read))
        if spec.collect is not None:
            for value in spec.collect.first:
                ref = part.values[value]
                self.store.retain(ref, part.request_id)
                frame.collected.append(ref)
        part.loops.append(frame)

    def exit(self, part: PartitionRun, loop: int) -> None:
        """Leave loop `loop` (and the loops inside it): what it collected is
        written, and the cursor goes past it."""
        while True:
            frame = part.loops.pop()
            if frame.loop == loop:
                break
            self._drop(part, frame)
        spec = part.plan.loops[loop]
        if spec.loop.collect is not None:
            self._collect(part, spec.loop.collect, frame)
        self.move(part, spec.exit)

    def _collect(self, part: PartitionRun, collect: Collect, frame: Frame) -> None:
        rid = part.request_id
        # a loop that stopped before `each` was written collects nothing
        stacked = torch.stack([self.store.get(ref) for ref in frame.collected]) if frame.collected else torch.empty(0)
        self._drop(part, frame)
        self.write(part, collect.into, TensorRef(self.store.put(stacked, (rid,))), None)

    def _drop(self, part: PartitionRun, frame: Frame) -> None:
        for ref in frame.collected:
            self.store.release(ref, part.request_id)
        frame.collected.clear()

    def restart(self, part: PartitionRun, pc: int) -> None:
        """Put the cursor at `pc` outside every loop (a turn starts over at 0,
        or a partition closes past its end)."""
        while part.loops:
            self._drop(part, part.loops.pop())
        part.pc = pc

    def stream_done(self, part: PartitionRun) -> None:
        """`part` reads a stream that is over (or whose turn is): its
        innermost `StreamDone` loop ends, or, in none, its program."""
        for frame in reversed(part.loops):
            loop = part.plan.loops[frame.loop].loop
            if loop.until is not None and any(isinstance(r, StreamDone) for r in loop.until.rules()):
                self.exit(part, frame.loop)
                self.walker.advance(part)
                return
        self.restart(part, len(part.plan.program))
        self.walker.advance(part)

    def write(self, part: PartitionRun, name: str, ref: TensorRef, token: int | None) -> None:
        """`part` wrote `ref` as value `name`: counted by the loops it is in,
        gathered by their collections, fed to the streams it sources."""
        self.record(part, name, ref)
        self.walker.streams.feed(part, name, token if token is not None else ref)

    def record(self, part: PartitionRun, name: str, ref: TensorRef) -> None:
        """`write` without feeding streams: a step's outputs are all recorded
        before any of them starts a consumer, which may read the others."""
        old = part.values.get(name)
        if old is not None:
            self.store.release(old, part.request_id)
        part.values[name] = ref
        part.writes[name] = part.writes.get(name, 0) + 1
        for frame in part.loops:
            loop = part.plan.loops[frame.loop].loop
            if loop.value == name:
                frame.count += 1
            if loop.collect is not None and loop.collect.each == name:
                self.store.retain(ref, part.request_id)
                frame.collected.append(ref)
