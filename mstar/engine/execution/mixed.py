"""A mixed step: a decode group's rows (one token each) and new rows' prompt
tokens (a chunk each) in one forward of the group's mode. In: the group's
window and the new rows (`NewRows`); out: the step's packed inputs on the
host (`MixedInputs`), the group's rows first, so that the first n logits
rows are the group's and the rest those of the new rows whose prompt ends
at this step. A step of new rows alone packs the same way with no group rows
(`prompt_inputs`): a mixed graph then serves a short prompt that arrives when
no group is running.

Only a sampling KV component's name-only token modes mix (the scheduler's
`mix`), and only a group whose step reads its token alone (`LoopGroup.mixes`):
every row is then token ids at positions after its cached length (plus a
group row's rope delta), which one attention plan over ragged rows serves.
Positions are one per token ([n + k]) whatever the component's axes: every
axis of such a token is the same, and a model of M-RoPE axes expands them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import PartitionRun


@dataclass(eq=False)
class NewRows:
    """The new rows of a mixed step, in the scheduler's order."""

    parts: list[PartitionRun]
    kv: list[KVRow]
    prompts: list[torch.Tensor]          # each row's whole prompt ids [L], on the host
    spans: list[tuple[int, int]]         # the prompt tokens this step computes, [start, end)
    banned: list[tuple[int, ...]]        # ids each row may not sample

    @property
    def ends(self) -> list[int]:
        """The rows whose prompt ends at this step: they sample."""
        return [i for i, (p, (_, end)) in enumerate(zip(self.prompts, self.spans)) if end >= p.numel()]

    @property
    def lens(self) -> list[int]:
        return [end - start for start, end in self.spans]


@dataclass(eq=False)
class MixedInputs:
    """A mixed step's packed inputs, on the host but for the group's tokens."""

    group_tokens: torch.Tensor   # [n] the group's last tokens, on the device
    new_ids: torch.Tensor        # [k] the new rows' chunks, packed
    positions: torch.Tensor      # [n + k]
    query_start: torch.Tensor    # [n + m + 1]
    context_lens: torch.Tensor   # [n + m] tokens each row has cached
    block_tables: torch.Tensor   # [n + m, P]
    logits_index: torch.Tensor   # [n + ended] the group's tokens, then each ending new row's last
    ends: list[int]              # the new rows whose prompt ends at this step
    slots: torch.Tensor          # [n + m] each row's slot of per-row state (-1: none)

    @property
    def rows(self) -> int:
        return self.context_lens.numel()


def mixed_inputs(group: LoopGroup, sl: slice, new: NewRows) -> MixedInputs:
    """The packed inputs of a step of rows `sl` of `group` with `new`'s chunks."""
    positions = group.positions(sl)   # [axes, n] of equal rows for an M-RoPE component: one is all of them
    return _packed(group.tokens[sl], positions if positions.dim() == 1 else positions[0], group.kv_lens[sl],
                   group.block_table[sl], group.slots[sl], new)


def prompt_inputs(new: NewRows, device: torch.device) -> MixedInputs:
    """The packed inputs of a step of `new`'s chunks alone: a mixed step
    with no group rows, so that a mixed graph can serve a lone short prompt."""
    none = torch.zeros(0, dtype=torch.long)
    return _packed(none.to(device), none, none, torch.zeros(0, 1, dtype=torch.long), none, new)


def _packed(group_tokens: torch.Tensor, group_positions: torch.Tensor, group_lens: torch.Tensor,
            group_tables: torch.Tensor, group_slots: torch.Tensor, new: NewRows) -> MixedInputs:
    n = group_tokens.numel()
    lens = torch.tensor(new.lens, dtype=torch.long)
    ctx_new = torch.tensor([r.kv_len for r in new.kv], dtype=torch.long)
    new_ids = torch.cat([p.reshape(-1)[start:end] for p, (start, end) in zip(new.prompts, new.spans)]).long()
    # positions from each row's start (its cached length plus any rope delta), as a plain prefill takes them
    new_pos = torch.cat([torch.arange(r.start, r.start + k) for r, k in zip(new.kv, new.lens)])
    ends = torch.cumsum(lens, 0)
    query_start = torch.cat([torch.arange(n + 1), n + ends])
    width = max(group_tables.shape[1], max(len(r.pages) for r in new.kv))
    tables = torch.zeros(n + len(new.kv), width, dtype=torch.long)
    tables[:n, :group_tables.shape[1]] = group_tables
    for i, r in enumerate(new.kv):
        tables[n + i, :len(r.pages)] = torch.tensor(r.pages, dtype=torch.long)
    logits_index = torch.cat([torch.arange(n), n + ends[new.ends] - 1])
    return MixedInputs(group_tokens=group_tokens, new_ids=new_ids, positions=torch.cat([group_positions, new_pos]),
                       query_start=query_start, context_lens=torch.cat([group_lens, ctx_new]), block_tables=tables,
                       logits_index=logits_index, ends=new.ends,
                       slots=torch.cat([group_slots, torch.tensor([-1 if r.slot is None else r.slot for r in new.kv],
                                                                  dtype=torch.long)]))
