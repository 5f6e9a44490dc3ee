"""torch's profiler on a worker thread: a `Profile` request in, the finished
profiler out through the request's future once its seconds have passed.

torch's profiler records the ops of the thread that starts it, so the worker
starts and stops it itself; the event loop only waits on the future.
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from mstar.engine.messages import Profile


class WorkerProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._running: tuple[torch.profiler.profile, float, concurrent.futures.Future] | None = None

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, msg: Profile) -> None:
        if self._running is not None:
            msg.done.set_exception(RuntimeError("a profile is already running"))
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, with_stack=msg.stacks)
        prof.start()
        self._running = (prof, time.perf_counter() + msg.seconds, msg.done)

    def check(self) -> None:
        """Stop and hand over the profile once its time is up."""
        if self._running is not None and time.perf_counter() >= self._running[1]:
            prof, _, done = self._running
            self._running = None
            prof.stop()
            done.set_result(prof)
