"""Python's profiler over a device worker's plans (made and carried out), for
the benchmarks' `--cprofile`: `install` routes `Executor.run` and
`Executor.next_plan` through whatever profile `start` opened, until `stop`.
The worker's thread is the one profiled; the event loop's is not.
"""

from __future__ import annotations

import cProfile
from typing import Any, Callable

from mstar.engine.worker.executor import Executor

_OPEN: list[cProfile.Profile | None] = [None]  # the window's, while one is open


def install() -> None:
    """Put the executor's methods under the open profile (once per process)."""
    if not getattr(Executor.run, "profiled", False):
        Executor.run, Executor.next_plan = _profiled(Executor.run), _profiled(Executor.next_plan)


def start() -> cProfile.Profile:
    _OPEN[0] = prof = cProfile.Profile()
    return prof


def stop() -> cProfile.Profile | None:
    prof, _OPEN[0] = _OPEN[0], None
    return prof


def _profiled(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Executor, *args: Any) -> Any:
        prof = _OPEN[0]
        if prof is None:
            return method(self, *args)
        prof.enable()
        try:
            return method(self, *args)
        finally:
            prof.disable()
    call.profiled = True  # type: ignore[attr-defined]
    return call
