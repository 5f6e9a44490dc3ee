"""CUDA graphs of a KV mode with a signature (`Mode(graph=True)`), for steps
whose rows bring one query token each: a talker's frame, whose step is the
talker's layers, its code predictor's forwards and the draws between them,
thousands of small kernels that launch far slower than they run.

A step of n rows replays the graph of the smallest bucket >= n (and of the
sampler path its draws take, `draws.DRAW_KINDS`): the packed batch's ids,
positions and per-row inputs (their row shapes from `Model.graph_rows`) are
copied into the bucket's static buffers, the draws' parameters into
`StaticDraws`, the attention backend re-plans the bucket's static metadata
(padding rows point at the KV cache's scratch page), and the graph writes
the mode's outputs; the first n rows of each are copied out, so the next
replay cannot overwrite what the step returned. Anything else (more rows,
a longer query, a draw with a repetition penalty) runs eagerly. Captured at
startup, largest bucket first, one memory pool per sampler path.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mstar.engine.execution.graphs.cuda_graphs import GraphAttention
from mstar.engine.execution.draws import DRAW_KINDS, Draws, StaticDraws
from mstar.kernels.graph_capture import capture_buckets
from mstar.models.base import RowShape
from mstar.types import AttentionContext, TokenBatch


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: dict[str, torch.Tensor]


class KVModeGraphs:
    """`step`: the mode's method; `rows`: its per-row inputs besides the
    query, by signature name; `axes`: of the component's positions;
    `draws`: the tokens the mode draws itself per row (0: none)."""

    def __init__(self, name: str, step: Callable[[TokenBatch], dict[str, torch.Tensor]], attention: GraphAttention,
                 buckets: Sequence[int], device: torch.device, rows: dict[str, RowShape], axes: int = 1,
                 draws: int = 0) -> None:
        self.name = name
        self.step = step
        self.attention = attention
        self.buckets = sorted(set(buckets))
        self.device = device
        self.axes = axes
        top = self.buckets[-1]
        self._ids = torch.zeros(top, dtype=torch.long, device=device)
        self._positions = torch.zeros((top,) if axes == 1 else (axes, top), dtype=torch.long, device=device)
        self._starts = torch.zeros(top, dtype=torch.long, device=device)
        self._rows = torch.arange(top, dtype=torch.long, device=device)
        self._extra = {n: torch.zeros((top, *r.shape), dtype=r.dtype, device=device) for n, r in rows.items()}
        self._draws = StaticDraws(top, draws, device) if draws else None
        self._graphs: dict[tuple[int, str | None], _Graph] = {}
        self.fence = attention.fence  # shared with the backend's other graph sets: one staging

    def _batch(self, b: int, attn: AttentionContext, kind: str | None) -> TokenBatch:
        return TokenBatch(input_ids=self._ids[:b], positions=self._positions[..., :b],
                          query_start=torch.arange(b + 1, dtype=torch.long), logits_index=self._rows[:b], attn=attn,
                          extra={n: t[:b] for n, t in self._extra.items()}, start_positions=self._starts[:b],
                          draw=self._draws.bound(b, kind) if self._draws is not None and kind else None)

    def capture(self, show_progress: bool = True) -> None:
        empty_ctx = torch.zeros(0, dtype=torch.long)
        empty_table = torch.zeros(0, 1, dtype=torch.long)
        for kind in DRAW_KINDS if self._draws is not None else (None,):
            graphs = capture_buckets(
                self.device, self.buckets, lambda b: self.attention.plan_graph(b, empty_ctx, empty_table),
                lambda b, attn, kind=kind: self._tensors(self.step(self._batch(b, attn, kind))),
                f"capturing CUDA graphs of {self.name}" + (f" ({kind} draws)" if kind else ""), show_progress)
            self._graphs.update({(b, kind): _Graph(g, out) for b, (g, out) in graphs.items()})

    @staticmethod
    def _tensors(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def run(self, batch: TokenBatch, context_lens: torch.Tensor, pages: list[list[int]] | torch.Tensor,
            draws: Draws | None) -> dict[str, torch.Tensor] | None:
        """The mode's outputs for a packed `batch` of n one-token rows
        (`context_lens` [n] and `pages`: each row's cached tokens and pages,
        on the host; a block table [n, W] whose rows may run past their
        pages), or None where no graph serves it."""
        n = batch.input_ids.shape[0]
        if not self.fits(n) or batch.embeds or (draws is None) != (self._draws is None):
            return None
        kind = draws.kind if draws is not None else None
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        g = self._graphs.get((b, kind))
        if g is None or any(not isinstance(batch.extra.get(name), torch.Tensor) for name in self._extra):
            return None
        self._ids[:n].copy_(batch.input_ids, non_blocking=True)
        self._positions[..., :n].copy_(batch.positions.reshape(self._positions[..., :n].shape), non_blocking=True)
        if batch.start_positions is not None:
            self._starts[:n].copy_(batch.start_positions, non_blocking=True)
        for name, static in self._extra.items():
            static[:n].copy_(batch.extra[name].reshape(static[:n].shape), non_blocking=True)
        if b > n:
            self._ids[n:b].zero_()
            self._positions[..., n:b].zero_()
            self._starts[n:b].zero_()
            for static in self._extra.values():
                static[n:b].zero_()
        if draws is not None:
            assert self._draws is not None
            self._draws.load(draws, b)
        self.fence.wait()
        if isinstance(pages, torch.Tensor):
            table = pages
        else:
            width = max(len(p) for p in pages)
            table = torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.long)
        self.attention.plan_graph(b, context_lens, table)
        self.fence.record()
        g.graph.replay()
        return {name: out[:n].clone() for name, out in g.outputs.items()}
