"""Copies onto a device that never wait for the stream (`to_device`, from
`kernels/host_copy.py`, which models use too) and row selections built on
the host. The way back is `arena.stage_to_host`.
"""

from __future__ import annotations

import torch

from mstar.kernels.host_copy import index_on, to_device

__all__ = ["select_rows", "to_device"]


def select_rows(data: torch.Tensor, index: list[int]) -> torch.Tensor:
    """`data[index]` without a blocking copy: a Python list index becomes a
    pageable host tensor, and copying that to the device waits for the stream."""
    if len(index) == data.shape[0]:
        return data
    return data.index_select(0, index_on(index, data.device))
