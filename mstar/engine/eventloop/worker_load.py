"""The requests running on each device worker, counted as they start and as
their workers finish them, and what routing reads of them: a worker for each
partition of a new request (`Placement.route`): as few workers as it can,
the least loaded live ones.
Event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mstar.graph import WalkPlan
from mstar.placement import Placement

if TYPE_CHECKING:
    from mstar.engine.worker.device_worker import DeviceWorker


class WorkerLoad:
    def __init__(self, workers: Sequence[DeviceWorker], placement: Placement) -> None:
        self._workers = workers
        self._placement = placement
        self._index = {w.name: i for i, w in enumerate(workers)}
        # running requests with a part on each worker, and those whose root it runs: routing places a root by
        # the second (a part a placement pins to one device, a codec on the last, must not weigh that device
        # down as a home for roots), every other part by the first
        self._outstanding = [0] * len(workers)
        self._rooted = [0] * len(workers)

    def index(self, device: str) -> int:
        """The position among the workers of the one on `device`."""
        return self._index.get(device, 0)

    def route(self, plan: WalkPlan) -> dict[str, int]:
        """A worker for each partition of a new request (see `Placement.route`):
        as few workers as it can, the least loaded among the live ones."""
        dead = 1 << 30
        load = {w.name: (self._outstanding[i] if w.alive else dead) for i, w in enumerate(self._workers)}
        roots = {w.name: (self._rooted[i] if w.alive else dead) for i, w in enumerate(self._workers)}
        return {part: self._index[device] for part, device in self._placement.route(plan, load, roots).items()}

    def started(self, root: int, shards: Iterable[int]) -> None:
        """A request runs its root on worker `root` and has a part on each of `shards`."""
        self._rooted[root] += 1
        for w in shards:
            self._outstanding[w] += 1

    def finished(self, worker: int, root: bool) -> None:
        """`worker` is done with a request; `root`: it ran the request's root."""
        self._outstanding[worker] -= 1
        if root:
            self._rooted[worker] -= 1
