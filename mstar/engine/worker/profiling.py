"""torch's profiler on a worker thread: a `Profile` request in, the finished
profiler out through the request's future once its seconds have passed.

torch's profiler records the ops of the thread that starts it, so the worker
starts and stops it itself; the event loop only waits on the future. The
profiler is one per process (two at once crash it), so a profile asked for
while any worker runs one fails with a RuntimeError. Once started, a
profile's future cannot be cancelled (a client that hung up must not leave
the worker a future it cannot resolve), and whatever happens to the worker,
the future is resolved: with the profile, or with the error (`ProfilerBusy`
for the first case).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import torch

from mstar.engine.messages import Profile
from mstar.errors import ProfilerBusy

_ONE_AT_A_TIME = threading.Lock()  # torch's profiler is process-wide


def ranged(name: str) -> contextlib.AbstractContextManager:
    """torch's profiler range `name` while a profile runs, else nothing: a
    range costs a torch op on entry (about 10 us of the worker's thread, and
    a chance for another thread to take the GIL) whether a profiler listens
    or not, and a decode step enters two."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _resolve(done: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


class WorkerProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._running: tuple[torch.profiler.profile, float, concurrent.futures.Future] | None = None

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, msg: Profile) -> None:
        if not msg.done.set_running_or_notify_cancel():
            return  # its client is gone already
        if not _ONE_AT_A_TIME.acquire(blocking=False):
            _resolve(msg.done, error=ProfilerBusy("a profile is already running in this process"))
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            # torch records ops' Python stacks only with the verbose config (2.13: `with_stack` alone leaves them empty)
            verbose = torch._C._profiler._ExperimentalConfig(verbose=True) if msg.stacks else None
            prof = torch.profiler.profile(activities=activities, with_stack=msg.stacks, experimental_config=verbose)
            prof.start()
        except Exception as e:  # the worker serves on without it
            _ONE_AT_A_TIME.release()
            _resolve(msg.done, error=RuntimeError(f"the profiler did not start: {e!r}"))
            return
        self._running = (prof, time.perf_counter() + msg.seconds, msg.done)

    def check(self) -> None:
        """Stop and hand over the profile once its time is up."""
        if self._running is not None and time.perf_counter() >= self._running[1]:
            self._finish(None)

    def close(self, reason: str) -> None:
        """The worker stops: a running profile ends with `reason` as its error."""
        if self._running is not None:
            self._finish(RuntimeError(reason))

    def _finish(self, error: BaseException | None) -> None:
        assert self._running is not None
        prof, _, done = self._running
        self._running = None
        try:
            prof.stop()
        except Exception as e:
            error = error or RuntimeError(f"the profiler did not stop: {e!r}")
        finally:
            _ONE_AT_A_TIME.release()
        _resolve(done, prof, error)
