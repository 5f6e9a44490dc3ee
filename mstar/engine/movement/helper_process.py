"""A helper process for work that should not hold the workers' GIL (media
decoding, say): calls in, results out, tensors shared rather than copied.

`HelperProcess(fn)` spawns one process that runs `fn(*args)` for each
`submit`. Arguments and results cross as follows:
- a CUDA tensor passes as a CUDA IPC handle (torch's multiprocessing
  reductions): the helper maps the same device memory, so it reads the
  caller's data and may write into a tensor the caller handed it;
- an `ArenaBlock` of the worker's `HostArena` passes as (arena name, offset,
  shape, dtype): the helper maps the same shared memory by name;
- other CPU tensors pass through torch's shared memory.
The caller keeps what it shared alive until the call's future resolves (CUDA
IPC memory must outlive the helper's use of it).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch
import torch.multiprocessing as mp

from mstar.engine.movement.arena import ArenaBlock


@dataclass(frozen=True)
class ArenaSlice:
    """A block of a host arena, by name: what the helper maps."""

    arena: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _pack(arg: Any) -> Any:
    if isinstance(arg, ArenaBlock):
        t = arg.tensor
        return ArenaSlice(arg.arena_name, arg.offset, tuple(t.shape), t.dtype)
    return arg


class _Mapped:
    """The helper's side: arenas it has mapped, by name."""

    def __init__(self) -> None:
        self.arenas: dict[str, tuple[shared_memory.SharedMemory, torch.Tensor]] = {}

    def unpack(self, arg: Any) -> Any:
        if not isinstance(arg, ArenaSlice):
            return arg
        if arg.arena not in self.arenas:
            from mstar.engine.movement.arena import attach

            self.arenas[arg.arena] = attach(arg.arena)
        region = self.arenas[arg.arena][1]
        nbytes = torch.Size(arg.shape).numel() * torch.empty((), dtype=arg.dtype).element_size()
        return region[arg.offset:arg.offset + nbytes].view(arg.dtype).view(arg.shape)

    def close(self) -> None:
        for shm, _ in self.arenas.values():
            shm.close()


def _serve(fn: Callable[..., Any], calls: Any, results: Any) -> None:
    mapped = _Mapped()
    try:
        while True:
            msg = calls.get()
            if msg is None:
                return
            call_id, args = msg
            try:
                out = fn(*[mapped.unpack(a) for a in args])
                if isinstance(out, torch.Tensor) and out.is_cuda:
                    torch.cuda.current_stream(out.device).synchronize()  # the caller reads it at once
                results.put((call_id, out, None))
            except Exception as e:  # the call fails; the helper serves on
                results.put((call_id, None, f"{type(e).__name__}: {e}"))
    finally:
        mapped.close()


class HelperProcess:
    def __init__(self, fn: Callable[..., Any], name: str = "mstar-helper") -> None:
        """`fn` must be importable by name (a module-level function): the
        helper is spawned, not forked, so CUDA works in it."""
        ctx = mp.get_context("spawn")
        self._calls = ctx.Queue()
        self._results = ctx.Queue()
        self._proc = ctx.Process(target=_serve, args=(fn, self._calls, self._results), name=name, daemon=True)
        self._proc.start()
        self._ids = itertools.count()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"{name}-results", daemon=True)
        self._reader.start()

    def submit(self, *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` in the helper; the future holds its result (CUDA
        tensors synchronised, so they can be read right away)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            self._futures[call_id] = future
        self._calls.put((call_id, [_pack(a) for a in args]))
        return future

    def _read(self) -> None:
        while True:
            try:
                msg = self._results.get()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            call_id, out, error = msg
            with self._lock:
                future = self._futures.pop(call_id, None)
            if future is None:
                continue
            if error is not None:
                future.set_exception(RuntimeError(f"the helper's call failed: {error}"))
            else:
                future.set_result(out)

    def close(self, timeout: float = 10.0) -> None:
        if not self._proc.is_alive():
            return
        self._calls.put(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._results.put(None)
        self._reader.join(timeout)
        with self._lock:
            for future in self._futures.values():
                future.set_exception(RuntimeError("the helper process stopped"))
            self._futures.clear()

    def __enter__(self) -> HelperProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
