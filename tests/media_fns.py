"""Decoders the media-front tests run in its spawned processes (importable by
name, as spawning needs), and `Hold`, the test's side of `held`: decodes
that wait at their start, in their process, until the test releases them, so
a test sees where and how many at once run without timing anything."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

HOLD_S = 90.0  # how long a held decode waits for its release before failing: past any test's own waits


def audio(data: str, field: str, **limits: object) -> np.ndarray:
    """The length of `data`, three times; "die" ends the process at once, as a
    decoder crashing in C code would."""
    if data == "die":
        os._exit(1)
    return np.full(3, float(len(data)), dtype=np.float32)


def image(url: str, field: str, **limits: object) -> np.ndarray:
    return np.zeros((2, 2, 3), dtype=np.uint8)


def held(folder: str, owner: int, decode: Callable[..., np.ndarray], data: str, field: str,
         **limits: object) -> np.ndarray:
    """`decode(data, field, **limits)` once `<folder>/release` exists; on
    arrival it leaves `<folder>/started-<pid>-<token>`. Refused at once in the
    test's own process (`owner`): there it would hold the test's event loop
    (or run on one of its threads), not a pool process."""
    if os.getpid() == owner:
        raise RuntimeError("a held decode ran in the test's own process, not in the pool's")
    path = Path(folder)
    (path / f"started-{os.getpid()}-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + HOLD_S
    while not (path / "release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a held decode was not released within {HOLD_S} s")
        time.sleep(0.005)
    return decode(data, field, **limits)


class Hold:
    """Holds decodes at their start: `hold(fn)` is `fn` as a held decoder
    (picklable, for a `Decoders`), `started` waits for decodes to be held,
    `release` lets them all go on, `reset` holds the next ones again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, decode: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        return partial(held, str(self.folder), os.getpid(), decode)

    def pids(self) -> list[int]:
        """The process of each decode held so far (one entry per decode)."""
        return sorted(int(p.name.split("-")[1]) for p in self.folder.glob("started-*"))

    async def started(self, count: int, pending: Sequence[asyncio.Future[Any]] = (),
                      timeout: float = 30.0) -> list[int]:
        """`pids()` once `count` decodes are held; fails loudly after `timeout`
        s, or as soon as one of `pending` (what waits on the decodes) ends."""
        deadline = time.monotonic() + timeout
        while len(self.pids()) < count:
            for future in pending:
                if future.done():
                    raise AssertionError(f"ended before {count} decodes were held ({self.pids()}): "
                                         f"{future.exception() or future.result()!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.pids())} of {count} decodes held within {timeout} s")
            await asyncio.sleep(0.01)
        return self.pids()

    def release(self) -> None:
        (self.folder / "release").touch()

    def reset(self) -> None:
        """Only once the released decodes have gone on (their results are in)."""
        for path in self.folder.iterdir():
            if path.name == "release" or path.name.startswith("started-"):
                path.unlink()
