"""Per-row state of a recurrent component (a gated delta net's conv and
recurrent states): `StateSpec` in, one tensor per named state of
[num_slots + 1, *shape] on the device out, the last slot scratch. A row
holds one slot from its first step until it finishes or is preempted; its
steps read and update it in place (`TokenBatch.state`). A preempted row's
state goes to host memory and comes back into whatever slot it is admitted
with next, as its KV pages do. Which slots are free is the scheduler's
bookkeeping, a page pool of one-slot pages.
"""

from __future__ import annotations

import torch

from mstar.models.base import StateSpec


class StatePool:
    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError("a state pool needs at least one slot")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.tensors = {name: torch.zeros(num_slots + 1, *shape, dtype=dtype, device=self.device)
                        for name, shape, dtype in spec.tensors}

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @staticmethod
    def bytes_per_slot(spec: StateSpec) -> int:
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                   for _, shape, dtype in spec.tensors)

    def zero(self, slot: int) -> None:
        """A row starts with an empty state."""
        for t in self.tensors.values():
            t[slot].zero_()

    def swap_out(self, slot: int) -> dict[str, torch.Tensor]:
        """Copy `slot`'s state to host memory, queued on the current stream
        behind the steps that wrote it; the slot may be reused by any step
        queued after this call."""
        pinned = self.device.type == "cuda"
        return {name: torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=pinned).copy_(t[slot], non_blocking=True)
                for name, t in self.tensors.items()}

    def swap_in(self, saved: dict[str, torch.Tensor], slot: int) -> None:
        """Write what `swap_out` saved into `slot`."""
        for name, t in self.tensors.items():
            t[slot].copy_(saved[name], non_blocking=True)
