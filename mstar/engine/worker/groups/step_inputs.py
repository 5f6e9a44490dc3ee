"""What a decode group's step reads of its rows' tables: the window's
sampling parameters, banned stop ids, positions, what they carried from
their last step, and the penalties' seen ids and output counts (kept up to
date as the step draws). `LoopGroup` holds the tables; this is the part of
it that `GroupSteps` reads each step.
"""

from __future__ import annotations

import torch

from mstar.engine.execution.sampler import SamplingTensors
from mstar.engine.worker.groups.group_tables import GroupTables


class StepInputs(GroupTables):
    """Rows `sl` of a `LoopGroup`'s tables, as its next step reads them."""

    axes: int
    shifted: bool
    banning: bool

    def sampling_for(self, sl: slice) -> SamplingTensors:
        assert self.sampling is not None
        return self.sampling if sl == slice(0, len(self.rows)) else self.sampling.rows(sl)

    def draws_for(self, sl: slice) -> SamplingTensors | None:
        """Rows `sl`'s parameters for the mode's own draws (None: it draws none)."""
        st = self.draw_sampling
        return st if st is None or sl == slice(0, len(self.rows)) else st.rows(sl)

    def banned(self, sl: slice) -> torch.Tensor | None:
        """Rows `sl`'s stop ids that their next step may not draw (its loop
        has not written `min_tokens` yet), [n, S] on the host, -1 pads;
        None when no row bans any."""
        if not self.banning:
            return None
        short = self.counts[sl] < self.mins[sl]
        if not bool(short.any()):
            # counts only grow: once no row is short of its min_tokens, none is until a row joins
            self.banning = bool((self.counts < self.mins).any())
            return None
        return torch.where(short[:, None], self.stop_table[sl], -1)

    def read_back(self, sl: slice) -> dict[str, torch.Tensor]:
        """What rows `sl`'s next step reads of their last one, by signature input name."""
        return {name: t[sl] for name, t in self.carried.items()}

    def positions(self, sl: slice) -> torch.Tensor:
        """Rows `sl`'s next positions on the host: [n], or [axes, n]."""
        pos = self.kv_lens[sl] + self.deltas[sl] if self.shifted else self.kv_lens[sl]
        return pos if self.axes == 1 else pos.expand(self.axes, -1)

    def update_seen(self, sl: slice) -> torch.Tensor | None:
        """Mark the tokens about to be fed back as seen (repetition penalty)."""
        if self.seen is None:
            return None
        # a scatter of a scalar: indexed assignment of a Python value waits for the device on CUDA
        window = self.seen[sl]
        tokens = self.tokens[sl].unsqueeze(1)
        if self.live is None:
            window.scatter_(1, tokens, True)
            return window
        # launches of several steps: a row's tokens after its stop id are not its own (nor seen by it); a stop
        # id itself is marked, as a single step's pipeline marks it in the step after
        live = self.live[sl]
        window.scatter_(1, tokens, window.gather(1, tokens) | live.unsqueeze(1))
        live &= (self.stop_ids[sl] != tokens).all(dim=1)
        return window

    def outputs_for(self, sl: slice, vocab: int) -> torch.Tensor | None:
        """Rows `sl`'s output counts for their draw, where a row of the group
        has a presence or frequency penalty (made on first use, [n, vocab])."""
        assert self.sampling is not None
        if self.outputs is None:
            if not self.sampling.any_output_penalty:
                return None
            self.outputs = torch.zeros(len(self.rows), vocab, dtype=torch.float32, device=self.device)
        return self.outputs[sl]

    def count_outputs(self, sl: slice, drawn: torch.Tensor) -> None:
        """Count the tokens rows `sl` just drew (on the device), where the group counts."""
        if self.outputs is not None:
            window = self.outputs[sl]
            window.scatter_add_(1, drawn.reshape(-1, 1), torch.ones_like(window[:, :1]))
