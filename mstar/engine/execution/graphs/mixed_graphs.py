"""CUDA graphs of mixed steps: a decode group's rows and a few new rows'
prompt tokens (`mixed.py`) in one replay.

A bucket is (decode rows b, new tokens t): the step's packed tokens are the
group's n <= b rows (rows n.. pad as in a decode graph), then the new rows'
chunks, padded to t (`FlashInferAttention.plan_mixed_graph` lays the padding
out on the scratch page). The graph's logits rows are the b decode rows,
then one per new-row slot (its last token); a replay returns the group's n
and those of the new rows whose prompt ends. Inputs are staged in
page-locked memory, so a step is launched while the one before still runs;
the staging fence is the attention backend's, shared with its decode graphs,
as they share the decode buckets' planning buffers. Mixed steps that fit no bucket run eagerly.
A step of short prompts alone replays a bucket too, its group rows all padding
(`run_prompts`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch

from mstar.kernels.host_copy import StagingFence
from mstar.engine.execution.mixed import MixedInputs, NewRows, prompt_inputs
from mstar.engine.movement.transfer import to_device
from mstar.kernels.graph_capture import capture_buckets
from mstar.types import AttentionContext, TokenBatch

# new tokens a mixed graph takes (with its padding): a cached prompt's tail, a short prompt, a few of them
MIXED_TOKEN_BUCKETS = (32, 160, 512)


class MixedAttention(Protocol):
    mixed_rows: int
    fence: StagingFence

    @property
    def mixed_graph_buckets(self) -> list[tuple[int, int]]: ...

    def plan_mixed_graph(self, batch_size: int, tokens: int, context_lens: torch.Tensor, block_tables: torch.Tensor,
                         new_query_start: torch.Tensor, new_context_lens: torch.Tensor,
                         new_tables: torch.Tensor) -> AttentionContext: ...


class MixedGraphs:
    def __init__(self, step: Callable[[TokenBatch], dict[str, torch.Tensor]], attention: MixedAttention,
                 device: torch.device) -> None:
        self.step = step
        self.attention = attention
        self.device = device
        self.fence = attention.fence
        self.rows = attention.mixed_rows
        keys = attention.mixed_graph_buckets
        self.row_buckets = sorted({b for b, _ in keys})
        self.token_buckets = sorted({t for _, t in keys})
        top = max(self.row_buckets) + max(self.token_buckets)
        self._ids = torch.zeros(top, dtype=torch.long, device=device)
        self._positions = torch.zeros(top, dtype=torch.long, device=device)
        self._logits_rows = torch.zeros(max(self.row_buckets) + self.rows, dtype=torch.long, device=device)
        self._pinned_ids = torch.zeros(top, dtype=torch.long, pin_memory=True)
        self._pinned_positions = torch.zeros(top, dtype=torch.long, pin_memory=True)
        self._pinned_rows = torch.zeros(self._logits_rows.numel(), dtype=torch.long, pin_memory=True)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    @property
    def max_new_tokens(self) -> int:
        """Most new tokens a replay takes: its largest bucket less the padding
        rows (one token each) it keeps at least."""
        return max(t for _, t in self._graphs) - self.rows - 1 if self._graphs else 0

    def _batch(self, b: int, t: int, attn: AttentionContext) -> TokenBatch:
        return TokenBatch(input_ids=self._ids[:b + t], positions=self._positions[:b + t],
                          query_start=torch.zeros(1, dtype=torch.long), logits_index=self._logits_rows[:b + self.rows],
                          attn=attn)

    def capture(self, show_progress: bool = True) -> None:
        empty, table = torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long)
        starts = torch.zeros(1, dtype=torch.long)

        def prepare(key: tuple[int, int]) -> AttentionContext:
            return self.attention.plan_mixed_graph(*key, empty, table, starts, empty, table)

        def step(key: tuple[int, int], attn: AttentionContext) -> torch.Tensor:
            return self.step(self._batch(*key, attn))["logits"]
        graphs = capture_buckets(self.device, self.attention.mixed_graph_buckets, prepare, step,
                                 "capturing mixed-step CUDA graphs", show_progress)
        self._graphs = dict(graphs)

    def fits(self, m: MixedInputs) -> tuple[int, int] | None:
        """The bucket of a mixed step, or None: it runs eagerly."""
        n, new_rows = m.group_tokens.numel(), m.rows - m.group_tokens.numel()
        need = m.new_ids.numel() + (self.rows - new_rows) + 1
        if new_rows > self.rows:
            return None
        i, j = bisect.bisect_left(self.row_buckets, n), bisect.bisect_left(self.token_buckets, need)
        if i == len(self.row_buckets) or j == len(self.token_buckets):
            return None
        key = (self.row_buckets[i], self.token_buckets[j])
        return key if key in self._graphs else None

    def run_prompts(self, new: NewRows) -> torch.Tensor | None:
        """The logits of `new`'s rows whose prompt ends, from a step of those
        chunks alone (no group rows), or None: they fit no bucket."""
        return self.run(prompt_inputs(new, self.device))

    def run(self, m: MixedInputs) -> torch.Tensor | None:
        """The logits of the group's rows, then of the new rows whose prompt
        ends (as `MixedInputs.logits_index` orders them), or None."""
        key = self.fits(m)
        if key is None:
            return None
        b, t = key
        n, k = m.group_tokens.numel(), m.new_ids.numel()
        new_rows = m.rows - n
        self.fence.wait()  # the previous step's inputs have landed: the staging is free
        ids, pos, rows = self._pinned_ids, self._pinned_positions, self._pinned_rows
        ids[:b + t].zero_()
        if m.new_ids.device.type == "cpu":
            ids[b:b + k].copy_(m.new_ids)
        pos[:b + t].zero_()
        pos[:n].copy_(m.positions[:n])
        pos[b:b + k].copy_(m.positions[n:])
        ends = torch.cumsum(m.query_start[n + 1:] - m.query_start[n:-1], 0)
        rows[:b] = torch.arange(b)
        rows[b:b + new_rows] = b + ends - 1
        rows[b + new_rows:b + self.rows] = b + k + torch.arange(self.rows - new_rows)  # the slots' padding tokens
        self._ids[:b + t].copy_(ids[:b + t], non_blocking=True)
        self._ids[:n].copy_(m.group_tokens)  # in stream order, after the staged copy
        if m.new_ids.device.type != "cpu":
            self._ids[b:b + k].copy_(m.new_ids)
        self._positions[:b + t].copy_(pos[:b + t], non_blocking=True)
        self._logits_rows[:b + self.rows].copy_(rows[:b + self.rows], non_blocking=True)
        self.attention.plan_mixed_graph(b, t, m.context_lens[:n], m.block_tables[:n],
                                        m.query_start[n:] - n, m.context_lens[n:], m.block_tables[n:])
        self.fence.record()
        graph, logits = self._graphs[key]
        graph.replay()
        pick = torch.cat([torch.arange(n), b + torch.tensor(m.ends, dtype=torch.long)])
        return logits[to_device(pick, self.device)]
