"""Copies between the host and a CUDA device that never wait for the
stream: host tensors go through page-locked memory, so a copy queues behind
the steps in flight instead of blocking the host until they finish (a copy
from pageable memory does), and rows come back with an event that says when
they can be read.
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


def to_host(rows: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor | list[torch.Tensor],
                                                              torch.cuda.Event | None]:
    """Rows copied to the host without blocking: (host rows, the copy's event);
    on the CPU the rows themselves and None."""
    def pinned_copy(r: torch.Tensor) -> torch.Tensor:
        return torch.empty(r.shape, dtype=r.dtype, pin_memory=True).copy_(r, non_blocking=True)

    first = rows[0] if isinstance(rows, list) and rows else rows
    if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return rows, None
    host = [pinned_copy(r) for r in rows] if isinstance(rows, list) else pinned_copy(rows)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def select_rows(data: torch.Tensor, index: list[int]) -> torch.Tensor:
    """`data[index]` without a blocking copy: a Python list index becomes a
    pageable host tensor, and copying that to the device waits for the stream."""
    if len(index) == data.shape[0]:
        return data
    return data.index_select(0, to_device(torch.tensor(index, dtype=torch.long), data.device))
