"""The tables a decode group holds over its rows, as its parts read them
(`StepInputs`, `GroupPages`, `GroupLeaving`): declared once here, built and
kept by `LoopGroup`.
"""

from __future__ import annotations

import torch

from mstar.engine.execution.sampler import SamplingTensors
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import PartitionRun


class GroupTables:
    """A `LoopGroup`'s rows and their tables (host tensors unless noted)."""

    device: torch.device
    rows: list[PartitionRun]
    kv_rows: list[KVRow]           # each row's KV row of the group's component
    request_ids: list[str]
    partitions: list[str]
    _joins: list                   # rows that joined since the last step, merged before it
    tokens: torch.Tensor           # on the device: each row's last token
    kv_lens: torch.Tensor
    counts: torch.Tensor
    caps: torch.Tensor
    mins: torch.Tensor
    counters: torch.Tensor
    slots: torch.Tensor
    deltas: torch.Tensor
    drawn: torch.Tensor
    block_table: torch.Tensor
    page_counts: torch.Tensor
    stop_table: torch.Tensor
    stop_ids: torch.Tensor         # the stop table, on the device
    carried: dict[str, torch.Tensor]  # on the device
    sampling: SamplingTensors | None
    draw_sampling: SamplingTensors | None
    seen: torch.Tensor | None      # on the device
    outputs: torch.Tensor | None   # on the device
    live: torch.Tensor | None      # on the device
