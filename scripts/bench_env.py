"""What a benchmark records about where it ran: package versions and the
commit (shared by the decode and speech benchmarks' reports); and the median
time of a call, synchronised on CUDA."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def version(*dists: str) -> str:
    """The installed version of the first distribution found."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def commit(repo: Path) -> str:
    """Short HEAD of `repo`, marked `-dirty` with uncommitted changes to
    tracked files (the numbers may not be HEAD's then). `$MSTAR_COMMIT`, when
    set, wins: the device tool's copy of the tree carries a `.git` that can be
    older than the files it runs."""
    if os.environ.get("MSTAR_COMMIT"):
        return os.environ["MSTAR_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=7",
                              "--exclude", "*"], capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def timed(fn: Callable[[], object], device, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn()` on `device` (a torch.device), synchronised on CUDA."""
    import torch  # only the timing benchmarks need it

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
