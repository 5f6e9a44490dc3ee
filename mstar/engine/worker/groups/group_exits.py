"""A decode group's row leaving its group and coming back, on the walker's
side (a mixin of `Walker`): a `Leave` in (preempted, parked for its
stream's next item, or its loop ended), the row's next work out: queued to
resume, parked, or moved on like any row's step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.movement.transfer import to_device
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.groups.pending import Leave
from mstar.engine.worker.rows import PartitionRun, Work
from mstar.scheduler import Scheduler, WorkItem


class GroupExits:
    """The walker's handling of rows that leave their `LoopGroup`."""

    store: TensorStore
    scheduler: Scheduler
    device: torch.device
    groups: dict[tuple, LoopGroup]

    if TYPE_CHECKING:  # the walker's own
        def advance(self, part: PartitionRun) -> None: ...
        def completed(self, part: PartitionRun, outputs: dict[str, TensorRef], reason: str | None,
                      tokens: dict[str, int] | None = None, branch: str = "main") -> None: ...

    def preempted(self, leave: Leave, pages: int, slot: bool) -> None:
        """A group row was preempted (its `pages` freed, its KV in host
        memory; with `slot`, its state slot too): it waits in its loop's
        queue for as many pages (and a slot), then resumes."""
        part = leave.part
        self._keep_group_values(leave)
        part.busy = True
        step = part.current_step()
        self.scheduler.add(WorkItem(part.request_id, part.name, step.component, step.mode, 1, pages,
                                    payload=Work(part, {}, rejoin=True), starts_row=True, needs_slot=slot))

    def _keep_group_values(self, leave: Leave) -> None:
        """What a row taken out of its group with its state exact reads when
        it comes back: its last token and the values its step reads back."""
        part = leave.part
        loop = part.loop()
        assert loop is not None
        for value, tensor in {loop.value: leave.token, **leave.carried}.items():
            part.values[value] = TensorRef(self.store.put(tensor, (part.request_id,)))

    def awaits_stream(self, leave: Leave) -> None:
        """A group row whose stream had no item for its next step left its
        group, pages kept: it parks, and joins again once one is there."""
        self._keep_group_values(leave)
        leave.part.busy = False
        self.advance(leave.part)

    def resume(self, part: PartitionRun) -> None:
        """A preempted row has its pages and KV back: into its group again."""
        part.busy = False
        self.advance(part)

    def left_group(self, leave: Leave, extras: dict[str, TensorRef] | None = None) -> None:
        """A row's loop stopped inside its group: move it on like any row.
        `extras`: the hidden states the group kept of its last step."""
        part = leave.part
        loop = part.loop()
        assert loop is not None
        value = loop.value
        # on the device, like the loop's other writes (a leave made from the host's copy is queued on the
        # worker's stream from page-locked memory: nothing waits)
        ref = TensorRef(self.store.put(to_device(leave.token, self.device), (part.request_id,)))
        host = {value: leave.host_token} if leave.host_token is not None else None
        self.completed(part, {value: ref, **(extras or {})}, leave.reason, host)

    def _take_out_of_groups(self, request_id: str, partition: str | None, count_sampled: bool = False) -> int:
        n = 0
        for group in self.groups.values():
            for leave in group.take_out(request_id, partition, count_sampled):
                leave.part.busy = False
                n += 1
        return n
