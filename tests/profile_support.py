"""What the profiler tests share: control over when a worker's profile ends,
so that they depend on what the worker did, not on how fast this box is.

`WorkerProfiler.check` (on the worker thread, between steps) ends a profile
once its seconds are up. A `ProfileGate` lets it do so only once the test has
released the gate (a profile held open while a second one is asked for) and
once its worker has run `steps` steps since the profile started (a profile
that must see a step, however slowly the worker runs). Its seconds still
count: the gate only ever makes a profile longer. Deadlines fail the test
loudly, naming what did not happen (`http_support.wait_until`, asserted).
"""

from __future__ import annotations

import threading

import pytest
from http_support import wait_until

from mstar.engine.engine import Engine
from mstar.engine.messages import Profile
from mstar.engine.worker import profiling
from mstar.engine.worker.profiling import WorkerProfiler

DEADLINE_S = 30.0  # for anything a test waits on: far past any loaded box, and a loud failure past it


def profiler_free() -> bool:
    """No profile holds the process's one profiler."""
    return not profiling._ONE_AT_A_TIME.locked()


class ProfileGate:
    """While the test runs (`monkeypatch` undoes it), a profile of `engine`'s
    workers ends at its time only once released (`held=False`: from the
    start) and once its worker has run `steps` steps inside it."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch, *, held: bool = True, steps: int = 0) -> None:
        self._engine = engine
        self._workers = {w.profiler: w for w in engine.workers}
        self._steps = steps
        self._released = threading.Event()
        if not held:
            self._released.set()
        self._steps_at_start: dict[WorkerProfiler, int] = {}  # written and read on the worker threads
        start, check = WorkerProfiler.start, WorkerProfiler.check

        def gated_start(profiler: WorkerProfiler, msg: Profile) -> None:
            start(profiler, msg)
            worker = self._workers.get(profiler)
            if profiler.running and worker is not None:
                self._steps_at_start[profiler] = worker.stats.steps

        def gated_check(profiler: WorkerProfiler) -> None:
            if profiler.running and not self._may_end(profiler):
                return
            check(profiler)

        monkeypatch.setattr(WorkerProfiler, "start", gated_start)
        monkeypatch.setattr(WorkerProfiler, "check", gated_check)

    def _may_end(self, profiler: WorkerProfiler) -> bool:
        worker = self._workers.get(profiler)
        if worker is None:  # another engine's
            return True
        at_start = self._steps_at_start.get(profiler)
        stepped = at_start is None or worker.stats.steps - at_start >= self._steps  # None: started before the gate
        return self._released.is_set() and stepped

    def release(self) -> None:
        self._released.set()

    async def running(self, worker: int = 0) -> None:
        """Until worker `worker` runs a profile (it holds the process's profiler)."""
        assert await wait_until(lambda: self._engine.workers[worker].profiler.running, DEADLINE_S), \
            f"no profile started on worker {worker} within {DEADLINE_S:g} s"
