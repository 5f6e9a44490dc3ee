"""What a benchmark records about where it ran: package versions and the
commit (shared by the decode and speech benchmarks' reports)."""

from __future__ import annotations

import os
import subprocess
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
