"""Launches of several decode steps, counted while a block runs: for the
`--num-scheduler-steps` tests (`test_multi_step*.py`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from mstar.engine.engine import Engine
from mstar.engine.worker.executor import Executor

T = TypeVar("T")


@contextlib.contextmanager
def launches(ran: list[int] | None = None, of: str | None = None) -> Iterator[list[int]]:
    """The steps planned for each launch of several (of component `of`'s
    groups only, if given), while the block runs; `ran` gets the steps each
    of them ran."""
    planned: list[int] = []
    launch_steps = Executor._launch_steps

    def counting_launch(self, group, sl, runner, k, *rest):  # type: ignore[no-untyped-def]
        if of is None or group.component == of:
            planned.append(k)
        out = launch_steps(self, group, sl, runner, k, *rest)
        if ran is not None and (of is None or group.component == of):
            ran.append(out[0].steps)
        return out

    Executor._launch_steps = counting_launch  # type: ignore[method-assign]
    try:
        yield planned
    finally:
        Executor._launch_steps = launch_steps  # type: ignore[method-assign]


async def together(eng: Engine, calls: list[Coroutine[Any, Any, T]]) -> tuple[list[T], list[int]]:
    """`calls` run together on the started `eng`, which then shuts down; and
    the steps of each launch of several meanwhile."""
    try:
        with launches() as planned:
            return list(await asyncio.gather(*calls)), planned
    finally:
        await eng.shutdown()
