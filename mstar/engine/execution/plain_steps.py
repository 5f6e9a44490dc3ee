"""Steps of plain (non-KV) modes on one device: the rows' inputs stacked
into one call, a captured graph's replay where one fits (`mode_graphs.py`),
and what the mode returned named by the step. Rows of other shapes (a
stream's short last chunk) run in one call per shape, so they leave the
other rows their graph.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from mstar.engine.execution.graphs.mode_graphs import ModeGraphs
from mstar.engine.execution.pack import named_outputs, stacked
from mstar.engine.movement.transfer import to_device
from mstar.graph import Mode, Step, step_bindings
from mstar.types import StateRows


def step_outputs(step: Step, out: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a name-only mode returned (one tensor, or a dict), by the step's output names."""
    if isinstance(out, torch.Tensor):
        out = {step.outputs[0]: out}
    if len(step.outputs) == 1 and len(out) == 1:
        return {step.outputs[0]: next(iter(out.values()))}
    missing = [n for n in step.outputs if n not in out]
    if missing:
        raise RuntimeError(f"{step.label} returned {sorted(out)}, not {missing}")
    return {n: out[n] for n in step.outputs}


class PlainSteps:
    def __init__(self, graphs: dict[str, ModeGraphs], device: torch.device) -> None:
        self.graphs = graphs
        self.device = device

    def run(self, inputs: list[dict[str, torch.Tensor]], step: Step, fn: Callable,
            seeds: torch.Tensor | None) -> dict:
        """Rows of a name-only mode by input name; `seeds` [B] on the host,
        for modes that take them."""
        shapes = [tuple(row[n].shape for n in step.inputs) for row in inputs]
        if len(set(shapes)) == 1:
            return self._stacked(inputs, step, fn, seeds)
        by_shape: dict[tuple, list[int]] = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(shape, []).append(i)
        rows: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        for idx in by_shape.values():
            out = self._stacked([inputs[i] for i in idx], step, fn, None if seeds is None else seeds[idx])
            for j, i in enumerate(idx):
                rows[i] = {n: out[n][j] for n in step.outputs}
        return {n: [row[n] for row in rows] for n in step.outputs}

    def _stacked(self, inputs: list[dict[str, torch.Tensor]], step: Step, fn: Callable,
                 seeds: torch.Tensor | None) -> dict:
        """Rows of one shape in one call: a graph replay where one fits."""
        columns = [[row[n] for row in inputs] for n in step.inputs]
        batch = [torch.stack(ts if len({t.device for t in ts}) == 1 else [t.to(self.device) for t in ts])
                 for ts in columns]
        graphs = self.graphs.get(step.mode)
        out = graphs.run(batch, seeds) if graphs is not None else None
        if out is None:
            batch = [to_device(a, self.device) for a in batch]
            out = fn(*batch) if seeds is None else fn(*batch, seeds=to_device(seeds, self.device))
        return step_outputs(step, out)

    def run_signed(self, inputs: list[dict[str, torch.Tensor]], step: Step, sig: Mode, fn: Callable,
                   seeds: torch.Tensor | None, has_state: bool) -> dict:
        """Rows of a plain mode with a signature, as keyword arguments by
        signature name: stacked over rows, or lists for ragged inputs; one
        call per row when other inputs differ in shape (`has_state`: `fn`
        carries the rows' slots of per-row state, as its keyword `state`)."""
        reads, writes = step_bindings(step, sig)
        specs = [i for i in sig.inputs if i.name in reads]
        rows = {i.name: [row[reads[i.name]] for row in inputs] for i in specs}
        if all(i.ragged or len({tuple(t.shape) for t in rows[i.name]}) == 1 for i in specs):
            kwargs = {i.name: stacked(i, rows[i.name], self.device) for i in specs}
            # a captured mode takes its inputs in signature order (`Model.graph_rows`), by position
            graphs = None if any(i.ragged for i in specs) or has_state else self.graphs.get(step.mode)
            out = graphs.run(list(kwargs.values()), seeds) if graphs is not None else None
            if out is None:
                out = self._call_named(fn, kwargs, seeds)
            return named_outputs(out, sig, writes, step.label)
        outs = []
        for r in range(len(inputs)):
            alone = {i.name: stacked(i, [rows[i.name][r]], self.device) for i in specs}
            call = fn
            if has_state:  # row r's own slot
                state = fn.keywords["state"]
                call = functools.partial(fn.func, state=StateRows(state.tensors, state.slots[r:r + 1],
                                                                  None if state.new is None else state.new[r:r + 1]))
            out = self._call_named(call, alone, None if seeds is None else seeds[r:r + 1])
            outs.append(named_outputs(out, sig, writes, step.label))
        return {v: [o[v][0] for o in outs] for v in writes.values()}

    def _call_named(self, fn: Callable, kwargs: dict, seeds: torch.Tensor | None):
        return fn(**kwargs) if seeds is None else fn(**kwargs, seeds=to_device(seeds, self.device))
