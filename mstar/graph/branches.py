"""What compiling a walk checks of forked KV rows: a partition's `Fork`
splits one KV row into branches, `Each` runs steps once per branch, and a
later step reads a per-branch value stacked over the branches that wrote it
(the join). One `Branches` per partition being compiled keeps which values
are per branch."""

from __future__ import annotations

from collections.abc import Callable

from mstar.errors import WalkError
from mstar.graph.nodes import Each, Fork, Step

SHARING = ("share", "fresh")


class Branches:
    def __init__(self, fail: Callable[[str, str], WalkError]) -> None:
        self.fail = fail
        self.names: tuple[str, ...] | None = None  # after the partition's fork: its branches, "main" first
        self.forked: str | None = None  # the KV component the fork split
        self.written: dict[str, tuple[str, ...]] = {}  # per-branch values, by the branches that wrote them
        self.ever: set[str] = set()

    def fork(self, fork: Fork, kv_components: list[str], where: str) -> str:
        """Check `fork`; the KV component it splits."""
        if self.names is not None:
            raise self.fail(where, "a partition forks its KV row once")
        names = [name for name, _ in fork.branches]
        if not names:
            raise self.fail(where, "a fork names at least one branch besides 'main'")
        if "main" in names or len(set(names)) != len(names):
            raise self.fail(where, f"branch names {names} repeat, or take 'main' (the row it has)")
        bad = [how for _, how in fork.branches if how not in SHARING]
        if bad:
            raise self.fail(where, f"a branch starts as {' or '.join(SHARING)}, not {bad[0]!r}")
        component = fork.component
        if component is None:
            if len(kv_components) != 1:
                raise self.fail(where, f"the partition has stepped KV components {kv_components}: "
                                       f"name the one to fork (component=)")
            component = kv_components[0]
        elif component not in kv_components:
            raise self.fail(where, f"forks '{component}', whose cache the partition has not written")
        self.names, self.forked = fork.names, component
        return component

    def each(self, each: Each, where: str) -> tuple[str, ...]:
        """Check `each`; the branches its steps run on."""
        if self.names is None:
            raise self.fail(where, "Each runs per branch of a Fork, and no Fork comes before it in its partition")
        only = each.only or self.names
        unknown = [b for b in only if b not in self.names]
        if unknown:
            raise self.fail(where, f"runs on branches {unknown} the fork does not make ({list(self.names)})")
        if not each.steps or not all(isinstance(s, Step) for s in each.steps):
            raise self.fail(where, "Each holds steps")
        return only

    def step(self, step: Step, where: str, branches: tuple[str, ...] | None) -> None:
        """`step` (inside an Each on `branches`, or not) reads and writes."""
        for value in step.inputs:
            wrote = self.written.get(value)
            if wrote is None:
                continue
            if branches is None and len(wrote) < 2:
                raise self.fail(where, f"joins '{value}' over one branch ('{wrote[0]}'): read it inside an Each")
            missing = [b for b in branches or () if b not in wrote]
            if missing:
                raise self.fail(where, f"branch '{missing[0]}' reads '{value}', which it does not write")
        for value in step.outputs:
            if branches is None:
                self.written.pop(value, None)
                continue
            assert self.names is not None
            wrote = set(self.written.get(value, ())) | set(branches)
            self.written[value] = tuple(b for b in self.names if b in wrote)
            self.ever.add(value)
