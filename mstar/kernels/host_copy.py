"""Copies from the host to a CUDA device that never wait for the stream:
host tensors go through page-locked memory, so a copy queues behind the
steps in flight instead of blocking the host until they finish (a copy from
pageable memory does). Models building a step's index tensors and the
engine's transfers both copy this way. A `StagingFence` says when the copies
out of a reused page-locked buffer have landed.
"""

from __future__ import annotations

import time

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from the host to CUDA without waiting (torch's pinned
    allocator keeps the staging block until the copy has run). The staging
    block is dense: `pin_memory` would keep an expanded tensor's strides and
    refuse to write its shared elements."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return staged.to(device, non_blocking=True)
    return t.to(device)


def index_on(values: list[int], device: torch.device | str) -> torch.Tensor:
    """An int64 index built on the host, on `device` without waiting."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def together_on(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` in one copy, each a view of it in
    its own shape: one launch (and one page-locked block) for a step's small
    index tensors instead of one each."""
    flat = to_device(torch.cat([t.reshape(-1) for t in tensors]), device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class StagingFence:
    """When a replay's host-to-device copies have landed: recorded once they
    are queued, waited for by the next replay before it rewrites the
    page-locked staging they read (a step is launched before the one before
    it is read). `wait_s`: how long the last wait took."""

    def __init__(self) -> None:
        self._copied: torch.cuda.Event | None = None
        self.wait_s = 0.0

    def wait(self) -> None:
        self.wait_s = 0.0
        if self._copied is None:
            self._copied = torch.cuda.Event()
            return
        t0 = time.perf_counter()
        self._copied.synchronize()
        self.wait_s = time.perf_counter() - t0

    def record(self) -> None:
        assert self._copied is not None, "record() follows wait()"
        self._copied.record()
