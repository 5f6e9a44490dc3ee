"""Per-row state of a recurrent component (a gated delta net's conv and
recurrent states): `StateSpec` in, one tensor per named state of
[num_slots + 1, *shape] on the device out, the last slot scratch. A row
holds one slot from its first step until it finishes; its steps read and
update it in place (`TokenBatch.state`). Which slots are free is the
scheduler's bookkeeping, a page pool of one-slot pages.
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
