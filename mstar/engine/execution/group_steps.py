"""Decode steps of a token loop group: the group's row tensors (tokens, KV
lengths, page tables, slots, what its rows carried from their last step) in,
one forward over a window of its rows (a decode graph's replay, a mode's
captured graph, or eagerly), with a mixed step's new rows' prompt chunks
riding along; a `GroupLaunch` out, its tokens sampled but not read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.engine.execution.backends import AttentionBackend
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs
from mstar.engine.execution.draws import Draws
from mstar.engine.execution.graphs.kv_mode_graphs import KVModeGraphs
from mstar.engine.execution.mixed import NewRows, mixed_inputs
from mstar.engine.execution.graphs.mixed_graphs import MixedGraphs
from mstar.engine.execution.pack import state_rows
from mstar.engine.execution.row_sampler import DeviceClock, RowSampler
from mstar.engine.memory.state_slots import StatePool
from mstar.engine.movement.transfer import to_device
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.types import TokenBatch


@dataclass(eq=False)
class GroupLaunch:
    """A launched group step's results, on the device and possibly not
    computed yet: its rows' tokens, the packed logprobs of the rows that
    asked, the outputs the group keeps (by walk value), and in a mixed step
    the tokens (and logprobs) of the new rows whose prompt ended."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    extras: dict[str, torch.Tensor]
    new_tokens: torch.Tensor | None = None
    new_logprobs: torch.Tensor | None = None


class GroupSteps:
    """A KV component's group steps. `graphs`: the decode graphs of token
    loop groups; `kv_graphs`: graphs of KV modes with a signature, which a
    group whose mode reads more than its token replays; `mixed_graphs`:
    graphs of mixed steps, where captured."""

    def __init__(self, module: nn.Module, device: torch.device, attention: AttentionBackend | None,
                 graphs: DecodeGraphs | None, kv_graphs: dict[str, KVModeGraphs], mixed_graphs: MixedGraphs | None,
                 state: StatePool | None, clock: DeviceClock, sampler: RowSampler) -> None:
        self.module = module
        self.device = device
        self.attention = attention
        self.graphs = graphs
        self.kv_graphs = kv_graphs
        self.mixed_graphs = mixed_graphs
        self.state = state
        self.clock = clock
        self.sampler = sampler
        self.mixed_replayed = False  # the last mixed step replayed one

    def run(self, group: LoopGroup, sl: slice, fed: list[int] | None = None,
            new: NewRows | None = None) -> GroupLaunch:
        """Launch one decode step of rows `sl` of a token loop group (with
        `new`: and those new rows' prompt chunks, a mixed step). `fed`: each
        row's stream item, where the step reads one."""
        assert self.attention is not None
        self.clock.reset()
        n = sl.stop - sl.start
        ctx = group.kv_lens[sl]
        logits = new_logits = None
        bucket = None   # of the decode graph replayed: its draw may replay too
        extras: dict[str, torch.Tensor] = {}
        if new is not None:
            logits = self._mixed_logits(group, sl, new)
            logits, new_logits = logits[:n], logits[n:]
        elif group.shape.reads_more:
            out = self._mode_step(group, sl, fed)
            logits = out["logits"]
            extras = {value: out[name] for name, value in group.extras.items()}
        elif self.graphs is not None:
            replayed = self.graphs.run(group.tokens[sl], ctx, group.block_table[sl],
                                       group.positions(sl) if group.shifted or group.axes > 1 else None,
                                       group.slots[sl] if self.state is not None else None)
            self.clock.seconds += self.graphs.fence.wait_s
            if replayed is not None:
                logits, bucket = replayed["logits"], self.graphs.bucket(n)
                # out of the static buffers, in stream order: the next replay rewrites them before they are read
                extras = {value: replayed[name].clone() for name, value in group.extras.items()}
        if logits is None:
            query_start = torch.arange(n + 1, dtype=torch.long)
            batch = TokenBatch(
                input_ids=group.tokens[sl],
                positions=to_device(group.positions(sl), self.device),
                query_start=query_start,
                logits_index=torch.arange(n, device=self.device),
                attn=self.attention.plan(query_start, ctx, group.block_table[sl]),
                state=state_rows(self.state, group.slots[sl], self.device),
            )
            out = self.clock.timed(getattr(self.module, group.mode))(batch)
            logits = out["logits"]
            extras = {value: out[name] for name, value in group.extras.items()}
        seen = group.update_seen(sl)
        st = group.sampling_for(sl)
        banned = group.banned(sl)
        outputs = group.outputs_for(sl, logits.shape[-1])
        launch = GroupLaunch(*self.sampler.group(logits, st, seen, None if banned is None
                                                 else to_device(banned, self.device), bucket, outputs), extras)
        if new is not None:
            assert new_logits is not None
            ends = new.ends
            launch.new_tokens, launch.new_logprobs = self.sampler.rows(
                new_logits, [new.parts[i] for i in ends], [new.kv[i] for i in ends],
                [new.prompts[i].reshape(-1) for i in ends], [new.banned[i] for i in ends], wait=False)
            ended = set(ends)
            for i, (r, k) in enumerate(zip(new.kv, new.lens)):
                r.advance(k, None, i in ended)
        # last: a step that raised above is run again without its new rows, on the group as it was
        group.count_outputs(sl, launch.tokens)
        return launch

    def _mixed_logits(self, group: LoopGroup, sl: slice, new: NewRows) -> torch.Tensor:
        """The logits of a mixed step (`mixed.py`): the group's rows, then the
        new rows whose prompt ends at this step."""
        assert self.attention is not None
        m = mixed_inputs(group, sl, new)
        self.mixed_replayed = False
        if self.mixed_graphs is not None:
            with torch.profiler.record_function("mstar.replay"):
                replayed = self.mixed_graphs.run(m)
            if replayed is not None:
                self.clock.seconds += self.mixed_graphs.fence.wait_s
                self.mixed_replayed = True
                return replayed
        batch = TokenBatch(
            input_ids=torch.cat([m.group_tokens, to_device(m.new_ids, self.device)]),
            positions=to_device(m.positions, self.device),
            query_start=m.query_start,
            logits_index=to_device(m.logits_index, self.device),
            attn=self.attention.plan(m.query_start, m.context_lens, m.block_tables),
            state=state_rows(self.state, m.slots, self.device),
        )
        with torch.profiler.record_function("mstar.forward"):
            return self.clock.timed(getattr(self.module, group.mode))(batch)["logits"]

    def _mode_step(self, group: LoopGroup, sl: slice, fed: list[int] | None) -> dict[str, torch.Tensor]:
        """The outputs of a group step whose mode reads more than its token
        (`GroupShape`): what the rows carried from their last step, their
        stream items and their own draws go in as an item step packs them;
        the mode's captured graphs serve it where they fit."""
        assert self.attention is not None
        shape, n = group.shape, sl.stop - sl.start
        extra: dict[str, torch.Tensor] = dict(group.read_back(sl))
        if shape.fed is not None:
            assert fed is not None and len(fed) == n
            extra[shape.fed] = to_device(torch.tensor(fed, dtype=torch.long), self.device)
        draw = None
        if shape.draws is not None:
            st = group.draws_for(sl)
            assert st is not None
            draw = Draws(st, shape.draws[1])
        ctx = group.kv_lens[sl]
        query_start = torch.arange(n + 1, dtype=torch.long)
        # a copy that queues behind the step in flight: this one is launched before that one is read
        positions = to_device(group.positions(sl).contiguous(), self.device)
        # one token a row: each row starts at its position (every axis holds the same one)
        starts = positions if positions.dim() == 1 else positions[0]
        state = state_rows(self.state, group.slots[sl], self.device)
        batch = TokenBatch(input_ids=group.tokens[sl], positions=positions,
                           query_start=query_start, logits_index=torch.arange(n, device=self.device), attn=None,
                           extra=extra, start_positions=starts, state=state, draw=draw)
        graphs = self.kv_graphs.get(group.mode)
        out = None
        if graphs is not None and self.state is None and graphs.fits(n):
            with torch.profiler.record_function("mstar.replay"):
                out = graphs.run(batch, ctx, group.block_table[sl], draw)
            self.clock.seconds += graphs.fence.wait_s
        if out is None:
            batch.attn = self.attention.plan(query_start, ctx, group.block_table[sl])
            out = self.clock.timed(getattr(self.module, group.mode))(batch)
        return out
