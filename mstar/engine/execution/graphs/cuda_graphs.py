"""CUDA graphs of a KV component's decode step at batch-size buckets.

A decode step of n rows replays the graph of the smallest bucket >= n: the
rows' tokens and positions (their cached length plus any rope delta, on
every axis of an M-RoPE component) are copied into the bucket's static
inputs, the attention backend re-plans the bucket's static metadata (padding
rows point at the KV cache's scratch page), and the graph writes logits, and
the hidden states a decode mode declares, into its static outputs. Every
host-to-device copy is from page-locked memory, so a step can be prepared
and launched while the previous one still runs: the host waits only until
the previous step's inputs have landed. Steps larger than the largest bucket
run eagerly. Graphs are captured once at startup, largest bucket first,
sharing one memory pool. A component with per-row state (`StatePool`) also
copies its rows' slots into the bucket's static slots, padding rows taking
the pool's scratch slot, so the graph reads and updates the rows' states in
place.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from mstar.kernels.graph_capture import capture_buckets
from mstar.kernels.host_copy import StagingFence

from mstar.engine.memory.state_slots import StatePool
from mstar.types import AttentionContext, StateRows, TokenBatch

class GraphAttention(Protocol):
    fence: StagingFence  # over the page-locked staging of every graph set planning into its buckets

    def plan_graph(self, batch_size: int, context_lens: torch.Tensor,
                   block_tables: torch.Tensor) -> AttentionContext: ...


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: dict[str, torch.Tensor]


class DecodeGraphs:
    def __init__(self, step: Callable[[TokenBatch], dict[str, torch.Tensor]], attention: GraphAttention,
                 buckets: Sequence[int], device: torch.device, outputs: Sequence[str] = ("logits",),
                 axes: int = 1, state: StatePool | None = None) -> None:
        """`outputs`: what the step returns that a replay keeps ("logits" and
        a decode mode's hidden states); `axes`: of the positions it takes;
        `state`: the component's per-row state, if it has one."""
        self.step = step
        self.attention = attention
        self.buckets = sorted(set(buckets))
        self.device = device
        self.outputs = tuple(outputs)
        self.axes = axes
        top = self.buckets[-1]
        shape = (top,) if axes == 1 else (axes, top)
        self._ids = torch.zeros(top, dtype=torch.long, device=device)
        self._positions = torch.zeros(shape, dtype=torch.long, device=device)
        self._rows = torch.arange(top, dtype=torch.long, device=device)
        self._pinned_positions = torch.empty(shape, dtype=torch.long, pin_memory=True)
        self.state = state
        if state is not None:
            self._slots = torch.full((top,), state.scratch_slot, dtype=torch.long, device=device)
            self._pinned_slots = torch.empty(top, dtype=torch.long, pin_memory=True)
        self._graphs: dict[int, _Graph] = {}
        self.fence = attention.fence  # one per backend: its graph sets share its buckets' staging

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int | None:
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def _batch(self, b: int, attn: AttentionContext) -> TokenBatch:
        state = None if self.state is None else StateRows(self.state.tensors, self._slots[:b])
        return TokenBatch(input_ids=self._ids[:b], positions=self._positions[..., :b],
                          query_start=torch.arange(b + 1, dtype=torch.long), logits_index=self._rows[:b], attn=attn,
                          state=state)

    def capture(self, show_progress: bool = True) -> None:
        empty_ctx = torch.zeros(0, dtype=torch.long)
        empty_table = torch.zeros(0, 1, dtype=torch.long)
        graphs = capture_buckets(
            self.device, self.buckets, lambda b: self.attention.plan_graph(b, empty_ctx, empty_table),
            lambda b, attn: self._kept(self.step(self._batch(b, attn))), "capturing CUDA graphs", show_progress)
        self._graphs = {b: _Graph(graph, outputs) for b, (graph, outputs) in graphs.items()}

    def static_output(self, name: str) -> torch.Tensor | None:
        """The largest bucket's buffer of an output (what its replays
        rewrite), or None when nothing was captured."""
        graph = self._graphs.get(self.max_batch) if self.buckets else None
        return graph.outputs.get(name) if graph is not None else None

    def static_outputs(self, name: str) -> dict[int, torch.Tensor]:
        """Each bucket's buffer of an output, by bucket size."""
        return {b: g.outputs[name] for b, g in self._graphs.items() if name in g.outputs}

    def _kept(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [name for name in self.outputs if name not in out]
        if missing:
            raise RuntimeError(f"the decode step returned {sorted(out)}, not {missing}")
        return {name: out[name] for name in self.outputs}

    def run(self, tokens: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
            positions: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
        """The kept outputs of n rows (logits [n, V], ...: views of static
        buffers the next replay rewrites), or None when n is past the largest
        bucket. `positions` (host): [n], or [axes, n]; default the rows'
        cached lengths. `slots` (host, [n]): the rows' state slots, with state."""
        n = tokens.shape[0]
        b = self.bucket(n)
        if b is None or b not in self._graphs:
            return None
        self.fence.wait()  # the previous step's inputs have landed: its staging is free
        self._ids[:n].copy_(tokens, non_blocking=True)
        self._pinned_positions[..., :n].copy_(context_lens if positions is None else positions)
        self._positions[..., :n].copy_(self._pinned_positions[..., :n], non_blocking=True)
        if b > n:
            self._ids[n:b].zero_()
            self._positions[..., n:b].zero_()
        if self.state is not None:
            assert slots is not None and slots.numel() == n, "a step of rows with state needs their slots"
            self._pinned_slots[:n].copy_(slots)
            self._pinned_slots[n:b].fill_(self.state.scratch_slot)
            self._slots[:b].copy_(self._pinned_slots[:b], non_blocking=True)
        self.attention.plan_graph(b, context_lens, block_table)
        self.fence.record()
        g = self._graphs[b]
        g.graph.replay()
        return {name: out[:n] for name, out in g.outputs.items()}
