"""The new rows of a mixed step, on the worker: the scheduler's items that
ride in a decode group's step (`StepPlan.items` beside `StepPlan.group`), their
inputs out of the store, and what they sampled once the step is launched,
as step outputs to route (one per value name their walks give the token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar.engine.execution.mixed import NewRows
from mstar.engine.execution.group_steps import GroupLaunch
from mstar.engine.execution.runner import ComponentRunner, StepOutput
from mstar.scheduler import Batch, WorkItem


@dataclass(eq=False)
class MixedItems:
    items: list[WorkItem]
    inputs: list[dict[str, torch.Tensor]]  # each row's, taken out of the store (a chunk to come keeps them)
    rows: NewRows
    launch: GroupLaunch | None = None

    @classmethod
    def take(cls, items: list[WorkItem], runner: ComponentRunner) -> MixedItems | None:
        """The admitted `items` with their inputs (None: no item to run)."""
        if not items:
            return None
        inputs = runner.take_inputs(Batch(items[0].component, items[0].mode, items))
        return cls(items, inputs, _new_rows(items, inputs))

    @property
    def request_ids(self) -> list[str]:
        return [item.request_id for item in self.items]

    def outputs(self, handed_out: Callable[[torch.Tensor], torch.Tensor]) -> list[StepOutput]:
        """What the rows whose prompt ended sampled, one output per value
        name their steps write (reading them waits for the step, which the
        caller's stream waits for); `handed_out` marks the step's tensors as
        read on the caller's stream."""
        assert self.launch is not None and self.launch.new_tokens is not None
        ends = self.rows.ends
        new_tokens = handed_out(self.launch.new_tokens)
        logprobs = self.launch.new_logprobs
        host_logprobs = None if logprobs is None else handed_out(logprobs).cpu()
        by_name: dict[str, list[int]] = {}
        for j, i in enumerate(ends):
            by_name.setdefault(self.items[i].payload.part.current_step().outputs[0], []).append(j)
        out = []
        for name, idx in by_name.items():
            rows = [self.items[ends[j]] for j in idx]
            pick = torch.tensor(idx, dtype=torch.long)
            tokens = new_tokens if len(idx) == len(ends) else new_tokens[pick.to(new_tokens.device)]
            out.append(StepOutput([item.payload.part for item in rows], {name: tokens},
                                  None if host_logprobs is None else host_logprobs[pick],
                                  branches=[item.payload.branch for item in rows]))
        return out


def _new_rows(items: list[WorkItem], inputs: list[dict[str, torch.Tensor]]) -> NewRows:
    """The rows as the runner takes them: each computes its `chunk` of prompt
    tokens after the `done` ones."""
    parts = [item.payload.part for item in items]
    return NewRows(
        parts=parts,
        kv=[p.row(item.component, item.payload.branch) for p, item in zip(parts, items)],
        prompts=[row[p.current_step().inputs[0]].reshape(-1) for row, p in zip(inputs, parts)],
        spans=[(item.done, item.done + item.chunk) for item in items],
        banned=[item.payload.banned for item in items],
    )
