"""Float waveforms in, the PCM16 bytes a client hears out: the event loop
turns a step's audio into each request's chunk here."""

from __future__ import annotations

import numpy as np
import torch


def pcm16(data: torch.Tensor | list[torch.Tensor]) -> list[bytes]:
    """Float waveforms in [-1, 1] (a [B, S] batch or a list of [S] rows) as
    PCM16 little-endian bytes, one string per row."""
    def pcm(x: torch.Tensor) -> torch.Tensor:
        return (x.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)

    if isinstance(data, torch.Tensor):  # one conversion for the batch, then a slice per row
        batch = pcm(data.reshape(data.shape[0], -1)).numpy()
        return [row.tobytes() for row in batch]
    if not data:
        return []
    # rows of any lengths: one conversion of them all, then a slice per row
    rows = [r.reshape(-1) for r in data]
    flat = pcm(torch.cat(rows)).numpy()
    ends = np.cumsum([r.numel() for r in rows])
    return [flat[end - r.numel():end].tobytes() for r, end in zip(rows, ends)]
