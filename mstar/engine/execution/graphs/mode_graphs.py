"""CUDA graphs of a plain (non-KV) mode at batch-size buckets: the rows'
stacked inputs (and per-row seeds) in, the mode's outputs out.

A step of n rows whose inputs have the captured row shapes replays the graph
of the smallest bucket >= n: the inputs are copied into the bucket's static
buffers (host inputs through page-locked memory, `transfer.to_device`, so
nothing waits for the device; padding rows get zeros and seed 0, and their
outputs are ignored), the graph runs, and the first n rows of its static
outputs are copied out, so a later replay cannot overwrite what the step
returned. A mode may list several row shapes (a stream's short last window
beside its full ones: an eager call of a shape the process has not run
before costs tens of milliseconds of cuDNN planning, on the worker's thread,
while every stream waits); each is captured at every bucket. A step of other
shapes, or more rows than the largest bucket, returns None and runs eagerly.
Every graph is captured once at startup, largest first, sharing one memory
pool.
"""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mstar.kernels.graph_capture import capture_buckets

from mstar.engine.movement.transfer import to_device
from mstar.models.base import RowShape

Outputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: Outputs


def takes_seeds(fn: Callable) -> bool:
    """Whether a mode's method draws randomness per row (a `seeds` keyword)."""
    return "seeds" in inspect.signature(fn).parameters


class ModeGraphs:
    """`fn(*inputs[, seeds=])`: the mode's method; `shapes`: each set of
    per-row inputs (one `RowShape` per input) a graph is captured for at
    every bucket, all in one memory pool."""

    def __init__(self, name: str, fn: Callable[..., Outputs], shapes: Sequence[Sequence[RowShape]],
                 buckets: Sequence[int], device: torch.device) -> None:
        self.name = name
        self.fn = fn
        self.shapes = tuple(tuple(rows) for rows in shapes)
        self.seeded = takes_seeds(fn)
        self.buckets = sorted(set(buckets))
        self.device = device
        top = self.buckets[-1]
        self._inputs = [[torch.zeros((top, *r.shape), dtype=r.dtype, device=device) for r in rows]
                        for rows in self.shapes]
        self._seeds = torch.zeros(top, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def _call(self, key: tuple[int, int]) -> Outputs:
        b, s = key
        args = [t[:b] for t in self._inputs[s]]
        return self.fn(*args, seeds=self._seeds[:b]) if self.seeded else self.fn(*args)

    def capture(self, show_progress: bool = True) -> None:
        # keyed (bucket, -shape): largest bucket first, and within it the shapes in their order (largest first)
        keys = [(b, -s) for b in self.buckets for s in range(len(self.shapes))]
        graphs = capture_buckets(self.device, keys, lambda k: None, lambda k, _: self._call((k[0], -k[1])),
                                 f"capturing CUDA graphs of {self.name}", show_progress)
        self._graphs = {(b, -s): _Graph(graph, outputs) for (b, s), (graph, outputs) in graphs.items()}

    def fits(self, inputs: Sequence[torch.Tensor]) -> int | None:
        """The captured shape set that stacked `inputs` ([n, *row shape]
        each) replay, or None."""
        if not inputs or inputs[0].shape[0] > self.buckets[-1]:
            return None
        for s, rows in enumerate(self.shapes):
            if len(inputs) == len(rows) and all(tuple(t.shape[1:]) == r.shape and t.dtype == r.dtype
                                                 for t, r in zip(inputs, rows)):
                return s
        return None

    def run(self, inputs: Sequence[torch.Tensor], seeds: torch.Tensor | None = None) -> Outputs | None:
        """The mode's outputs for stacked `inputs`, or None when they do not fit."""
        s = self.fits(inputs)
        if s is None or (self.seeded and seeds is None):
            return None
        n = inputs[0].shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        for static, t in zip(self._inputs[s], inputs):
            static[:n].copy_(to_device(t, self.device))
            static[n:b].zero_()
        if self.seeded:
            assert seeds is not None
            self._seeds[:n].copy_(to_device(seeds, self.device))
            self._seeds[n:b].zero_()
        g = self._graphs[(b, s)]
        g.graph.replay()
        if isinstance(g.outputs, torch.Tensor):
            return g.outputs[:n].clone()
        return {k: v[:n].clone() for k, v in g.outputs.items()}
