"""A partition's nodes in, its program out: the flat list of instructions a
worker's cursor walks.

`Run` queues one step (once per branch row, inside an `Each`). `Enter`
starts a loop that no step's write enters; `Back` ends an iteration and
jumps to the loop's body again; `ForkRows` splits a KV row into branches. A loop is left
when the stop rule checked after a `Run` holds: the cursor then jumps past
the loop (`LoopPlan.exit`), out of any loops nested in it too. Nested loops
and bodies of several steps are just longer programs; the worker keeps one
frame per running loop (its iteration, its writes, what it collects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from mstar.graph.nodes import Each, Fork, Loop, Step


@dataclass(frozen=True)
class Run:
    """Queue `step`. `checks`: the loop whose stop rule judges what it writes
    (an index into `PartitionPlan.loops`); `enters`: that write enters the
    loop (the step just before it), so the loop's frame starts with this
    step. `depth`: loops around the step (`@i` is the innermost's
    iteration). `branches`: inside an `Each`, the branch rows it runs on
    (what it writes is theirs); `own`: the per-branch values it reads, each
    branch its own; `joins`: the per-branch values it reads stacked, and
    over which branches."""

    step: Step
    checks: int | None = None
    enters: bool = False
    depth: int = 0
    branches: tuple[str, ...] = ()
    own: tuple[str, ...] = ()
    joins: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class Enter:
    """Start loop `loop` (no step's write entered it)."""

    loop: int


@dataclass(frozen=True)
class Back:
    """The end of loop `loop`'s body: go round again."""

    loop: int


@dataclass(frozen=True)
class ForkRows:
    """Split the partition's KV row of `component` into the branches of `fork`."""

    fork: Fork
    component: str


Instr = Union[Run, Enter, Back, ForkRows]


@dataclass(frozen=True)
class LoopPlan:
    """A loop of a program: where its body starts and where the cursor goes
    when it ends; `depth` 0 is the partition's top level."""

    loop: Loop
    body: int
    exit: int
    depth: int


class ProgramBuilder:
    """Appends a partition's top-level steps and loops as instructions. Checks
    are the caller's (`compile.py`); this only lays the program out."""

    def __init__(self) -> None:
        self.program: list[Instr] = []
        self.loops: list[LoopPlan] = []
        self._open: list[int] = []  # the loops being laid out, outermost first
        self.branches: tuple[str, ...] = ("main",)  # after a `ForkRows`, its branches

    def __len__(self) -> int:
        return len(self.program)

    def fork(self, fork: Fork, component: str) -> None:
        self.program.append(ForkRows(fork, component))
        self.branches = fork.names

    def add(self, node: Step | Loop | Each, prev_run: int | None = None, depth: int = 0) -> int | None:
        """Append `node`; `prev_run` is the index of the Run just before it at
        the same level (its write may enter a loop). Returns the index of the
        Run a following loop may be entered by, or None."""
        if isinstance(node, Step):
            self.program.append(Run(node, checks=self._checks(node), depth=depth))
            return len(self.program) - 1
        if isinstance(node, Each):
            for step in node.steps:
                self.program.append(Run(step, depth=depth, branches=node.only or self.branches))
            return None
        index = len(self.loops)
        self.loops.append(LoopPlan(node, -1, -1, depth))  # placed once its body is laid out
        entering = self.program[prev_run] if prev_run is not None else None
        if isinstance(entering, Run) and node.value in entering.step.outputs and entering.checks is None:
            self.program[prev_run] = Run(entering.step, checks=index, enters=True, depth=depth)
        else:
            self.program.append(Enter(index))
        self._open.append(index)
        body = len(self.program)
        inner_prev: int | None = None
        for child in node.body:
            inner_prev = self.add(child, inner_prev, depth + 1)
        self._open.pop()
        self.program.append(Back(index))
        self.loops[index] = LoopPlan(node, body, len(self.program), depth)
        return None

    def finish(self) -> tuple[Instr, ...]:
        """The program, each Run told which per-branch values it reads: its
        own branch's (inside an `Each`), or stacked over the branches that
        wrote them (after it)."""
        per_branch: dict[str, tuple[str, ...]] = {}
        out: list[Instr] = []
        for ins in self.program:
            if isinstance(ins, Run):
                reads = [v for v in ins.step.inputs if v in per_branch]
                if ins.branches:
                    ins = Run(ins.step, ins.checks, ins.enters, ins.depth, ins.branches, own=tuple(reads))
                    for value in ins.step.outputs:
                        wrote = set(per_branch.get(value, ())) | set(ins.branches)
                        per_branch[value] = tuple(b for b in self.branches if b in wrote)
                else:
                    ins = Run(ins.step, ins.checks, ins.enters, ins.depth,
                              joins=tuple((v, per_branch[v]) for v in reads))
                    for value in ins.step.outputs:
                        per_branch.pop(value, None)
            out.append(ins)
        return tuple(out)

    def _checks(self, step: Step) -> int | None:
        """The innermost open loop whose value `step` writes."""
        for index in reversed(self._open):
            if self.loops[index].loop.value in step.outputs:
                return index
        return None
