"""Copies from the host to a CUDA device that never wait for the stream:
host tensors go through page-locked memory, so a copy queues behind the
steps in flight instead of blocking the host until they finish (a copy from
pageable memory does). The way back is `arena.stage_to_host`.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from the host to CUDA without waiting (torch's pinned
    allocator keeps the staging block until the copy has run)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def select_rows(data: torch.Tensor, index: list[int]) -> torch.Tensor:
    """`data[index]` without a blocking copy: a Python list index becomes a
    pageable host tensor, and copying that to the device waits for the stream."""
    if len(index) == data.shape[0]:
        return data
    return data.index_select(0, to_device(torch.tensor(index, dtype=torch.long), data.device))
