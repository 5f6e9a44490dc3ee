"""Token loops held as tensors.

The rows of one decode loop (a KV component that samples a token and reads it
back) stay together in a `LoopGroup` from the step after their prefill until
their stop rule holds. The group keeps what every step needs as tensors over
rows: the last tokens (on the device: loop-back never leaves it), positions,
block tables, sampling parameters and draw counters, write counts and caps,
stop ids. A step of the group touches no per-row Python: rows that joined are
merged once before the scheduler plans the step (`merge`), and only rows that
stop are handled one by one when they leave. Which rows a step runs, and
which rows get a page or are preempted first, the scheduler decides
(`StepPlan`); the group is what it reads (`scheduler.StandingGroup`).

A step is launched (`launched`) before the previous one is finalised
(`finalize`): the device computes step K while the host reads step K-1's
tokens. A row that stops at step K-1 on a token (EOS) has therefore already
been computed once more in step K; `finalize` drops that output. Rows that
reach their write cap are known on the host and are never launched past it.
On CUDA a group's steps and the updates of its tensors go on its component's
stream (`group_stream.py`), so that two components' decode overlap.

A launch may run several steps back to back (`--num-scheduler-steps`,
`multi_step.py`): between them each row's token and tables advance on the
device and in the host tables (`advance`), and one `Pending` holds them all;
a row that stops at one of them computes the rest for nothing, as it does
the step after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mstar.engine.execution.sampler import SamplingTensors
from mstar.engine.movement.transfer import to_device
from mstar.engine.worker.groups.group_leaving import GroupLeaving
from mstar.engine.worker.groups.group_pages import GroupPages
from mstar.engine.worker.groups.group_shape import GroupShape
from mstar.engine.worker.groups.group_stream import GroupStream
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.groups.multi_step import steps_room
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.worker.groups.pending import Leave, Pending, Route, route_of
from mstar.engine.worker.groups.step_inputs import StepInputs
from mstar.engine.worker.groups.row_tables import cat_padded, rows_of, stepped, with_rows

_NO_CAP = 2**62


@dataclass(eq=False)
class _Join:
    part: PartitionRun
    token: torch.Tensor   # scalar, on the device
    count: int            # writes of the loop value so far
    cap: int              # writes at which the loop stops ("length")
    stop_ids: tuple[int, ...]
    carried: dict[str, torch.Tensor]  # by signature input name: what its first step reads back
    min_tokens: int       # writes before which its stop ids may not be drawn


class LoopGroup(StepInputs, GroupPages, GroupLeaving):
    def __init__(self, component: str, mode: str, device: torch.device,
                 shape: GroupShape | None = None, axes: int = 1, stream: torch.cuda.Stream | None = None,
                 most_steps: int = 1, first_cut_room: Callable[[str], int | None] | None = None) -> None:
        """`shape`: what a step reads and keeps besides the token; `axes`: of
        the component's positions (every axis at a row's next position);
        `stream`: on CUDA, the one its steps and its tensors' updates go on
        (the component's groups share it), beside the worker's stream;
        `most_steps`: steps one launch may run (`multi_step.steps_room`), no
        more than `first_cut_room` says (`Streams.first_cut_room`). Rows
        of any walks whose loops step `component.mode` the same way share a
        group; each row's tokens go where its own walk sends them (`Route`)."""
        self.stream = GroupStream(stream, device)
        self.component = component
        self.mode = mode
        self._routes: dict[Route, int] = {}  # the routes of its rows, and how many rows each
        self.row_routes: list[Route] = []    # each row's (kept: a row whose loop ended may step on, held)
        self.device = device
        self.shape = shape or GroupShape()
        self.axes = axes
        self.ticket = -1
        self.rows: list[PartitionRun] = []
        self.kv_rows: list[KVRow] = []  # each row's KV row of the component: what a step's reader updates
        self.request_ids: list[str] = []
        self.partitions: list[str] = []
        self._joins: list[_Join] = []
        self.tokens = torch.empty(0, dtype=torch.long, device=device)
        self.kv_lens = torch.empty(0, dtype=torch.long)
        self.block_table = torch.empty(0, 1, dtype=torch.long)
        self.page_counts = torch.empty(0, dtype=torch.long)  # pages each row owns (its block table's width)
        self.counts = torch.empty(0, dtype=torch.long)
        self.caps = torch.empty(0, dtype=torch.long)
        self.mins = torch.empty(0, dtype=torch.long)  # each row's min_tokens
        self.banning = False  # some row may be short of its min_tokens (False: none is)
        self.stop_table = torch.full((0, 1), -1, dtype=torch.long)
        self.sampling: SamplingTensors | None = None
        self.counters = torch.empty(0, dtype=torch.long)  # host copy of the sampler's draw counters
        self.slots = torch.empty(0, dtype=torch.long)     # each row's slot of per-row state (-1: none)
        self.deltas = torch.empty(0, dtype=torch.long)    # each row's rope delta: its positions run ahead of kv_lens
        self.shifted = False                              # some row's delta is not 0
        self.seen: torch.Tensor | None = None
        self.most_steps = most_steps
        self.first_cut_room = first_cut_room
        # while launches may run several steps: [n] on the device, the rows that have drawn no stop id before
        # the token a step marks seen (what a row draws after its stop is never its own)
        self.live: torch.Tensor | None = None
        self.stop_ids = torch.full((0, 1), -1, dtype=torch.long, device=device)  # the stop table, on the device
        self.outputs: torch.Tensor | None = None  # [n, V] float32 output counts, once a row penalises them
        # what a step reads back of the step before, by signature input name: [n, ...] on the device
        self.carried: dict[str, torch.Tensor] = {}
        self.draw_sampling: SamplingTensors | None = None  # the mode's own draws' parameters and counters
        self.drawn = torch.empty(0, dtype=torch.long)      # host copy of those counters
        self.seq = 0                        # steps launched
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if device.type == "cuda" else []
        self.followed = 0  # rows that follow their ids for the prefix cache (`KVRow.follow`): read their tokens
        self._left: dict[int, int] = {}           # id(row) -> the launch after which it left
        self._left_at: dict[int, list[int]] = {}  # launch seq -> ids of the rows that left after it
        self._unread: Pending | None = None  # the last launch, while it is not read
        self._held: list[PartitionRun] | None = None  # rows that left during a launch, dropped once it is launched

    @property
    def extras(self) -> dict[str, str]:
        """What a step keeps besides its token: signature output name -> walk value."""
        return self.shape.extras

    def __len__(self) -> int:
        return len(self.rows) + len(self._joins)

    @property
    def mixes(self) -> bool:
        """Its steps may take new rows' prompt tokens beside its rows (a mixed
        step): a step that reads its token alone and keeps nothing else runs
        their tokens through the same call, at one position each (a decode
        row's token, and a name-only prompt's, sits at the same place on every
        M-RoPE axis)."""
        return not self.shape.reads_more and not self.shape.extras

    # ----------------------------------------------------------- membership

    def join(self, part: PartitionRun, token: torch.Tensor, count: int, cap: int | None,
             stop_ids: tuple[int, ...], carried: dict[str, torch.Tensor] | None = None, min_tokens: int = 0) -> None:
        """`carried`: by signature input name, what the row's first step in
        the group reads back (its last step's output, outside the group);
        `min_tokens`: writes before which `stop_ids` may not be drawn."""
        self._joins.append(_Join(part, token, count, _NO_CAP if cap is None else cap, stop_ids, dict(carried or {}),
                                 min_tokens))

    def hold_within(self, part: PartitionRun, ceiling: Callable[[int], int]) -> bool:
        """Lower `part`'s write cap so that its KV holds at most
        `ceiling(the KV it holds as its launched steps leave it)` tokens when
        its loop ends (a turn leaving room for the input queued behind it);
        False when the group does not hold it."""
        for j in self._joins:
            if j.part is part:
                kv_len = part.row(self.component).kv_len
                j.cap = min(j.cap, j.count + max(ceiling(kv_len) - kv_len, 0))
                return True
        i = next((i for i, row in enumerate(self.rows) if row is part), None)
        if i is None:
            return False
        kv_len = int(self.kv_lens[i])
        self.caps[i] = min(int(self.caps[i]), int(self.counts[i]) + max(ceiling(kv_len) - kv_len, 0))
        return True

    def joining(self) -> list[str]:
        """The requests of the rows that joined since the last step."""
        return [j.part.request_id for j in self._joins]

    def merge(self) -> None:
        """Fold the rows that joined since the last step into the tensors. All
        of it is built before any of it is kept: joins that cannot be built
        leave the group as it was, still waiting in `_joins`."""
        if not self._joins:
            return
        with self.stream.on():
            self.stream.after_worker()  # the joining rows' tokens and values come from its steps
            self._merge()

    def _merge(self) -> None:
        joins = self._joins
        for j in joins:
            self.stream.taken_in(j.token)
            for t in j.carried.values():
                self.stream.taken_in(t)
        parts = [j.part for j in joins]
        kv = [p.row(self.component) for p in parts]
        dev = self.device

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        new = SamplingTensors.build([p.sampling for p in parts], [p.seed for p in parts],
                                    [r.generated for r in kv], dev)
        tokens = torch.cat([self.tokens, torch.stack([j.token.reshape(()) for j in joins]).to(dev)])
        kv_lens = torch.cat([self.kv_lens, longs([r.kv_len for r in kv])])
        counts = torch.cat([self.counts, longs([j.count for j in joins])])
        caps = torch.cat([self.caps, longs([j.cap for j in joins])])
        mins = torch.cat([self.mins, longs([j.min_tokens for j in joins])])
        block_table = cat_padded(self.block_table, [r.pages for r in kv], 0)
        page_counts = torch.cat([self.page_counts, longs([len(r.pages) for r in kv])])
        stop_table = cat_padded(self.stop_table, [j.stop_ids for j in joins], -1)
        counters = torch.cat([self.counters, longs([r.generated for r in kv])])
        slots = torch.cat([self.slots, longs([-1 if r.slot is None else r.slot for r in kv])])
        deltas = torch.cat([self.deltas, longs([r.rope_delta for r in kv])])
        sampling = new if self.sampling is None else self.sampling.cat(new)
        for r in kv:
            for made in (r.seen, r.outputs):  # made by the row's earlier steps on the worker's stream
                if made is not None:
                    self.stream.taken_in(made)
        # one row of each per group row, once any row has one: a repetition penalty's seen ids (from its
        # prefill), the output counts of a presence or frequency penalty (from `outputs_for`, or a row's
        # earlier steps)
        seen = with_rows(self.seen, [r.seen for r in kv], len(self.rows), torch.bool, dev)
        outputs = with_rows(self.outputs, [r.outputs for r in kv], len(self.rows), torch.float32, dev)
        carried = {}
        for name in self.shape.carried:
            joined = torch.stack([j.carried[name] for j in joins]).to(dev)
            carried[name] = torch.cat([self.carried[name], joined]) if name in self.carried else joined
        draw_sampling = self.draw_sampling
        key = self.shape.draws[0] if self.shape.draws is not None else None
        draw_counts = [r.drawn.get(key, 0) if key is not None else 0 for r in kv]
        if key is not None:
            params = [p.request.sampling[key] for p in parts]
            more = SamplingTensors.build(params, [q.seed for q in params], draw_counts, dev)
            draw_sampling = more if draw_sampling is None else draw_sampling.cat(more)
        drawn = torch.cat([self.drawn, longs(draw_counts)])
        live = stop_ids = None
        if self.most_steps > 1:
            live = torch.cat([self.live if self.live is not None else torch.ones(len(self.rows), dtype=torch.bool,
                                                                                  device=dev),
                              torch.ones(len(joins), dtype=torch.bool, device=dev)])
            stop_ids = to_device(stop_table, dev)
        # nothing below raises
        self.tokens, self.kv_lens, self.counts, self.caps = tokens, kv_lens, counts, caps
        self.block_table, self.page_counts, self.stop_table = block_table, page_counts, stop_table
        self.counters, self.sampling, self.seen, self.slots = counters, sampling, seen, slots
        self.outputs = outputs
        self.deltas, self.shifted = deltas, bool(deltas.any())
        self.carried, self.draw_sampling, self.drawn = carried, draw_sampling, drawn
        self.mins = mins
        if live is not None and stop_ids is not None:
            self.live, self.stop_ids = live, stop_ids
        self.banning = self.banning or any(j.count < j.min_tokens for j in joins)
        self._joins = []
        self.rows += parts
        self.kv_rows += kv
        self.request_ids += [p.request_id for p in parts]
        self.partitions += [p.name for p in parts]
        for p, r in zip(parts, kv):
            self._left.pop(id(p), None)
            r.into_group()  # the group's copy, if any, is the live one now
            self.followed += r.token_ids is not None
            route = route_of(p)
            self._routes[route] = self._routes.get(route, 0) + 1
            self.row_routes.append(route)

    @property
    def emits(self) -> bool:
        """Some row's walk sends the loop's tokens to its client as they come
        (a text stream), rather than only to a consumer (a speech codec)."""
        return any(route.value in route.walk.emits for route in self._routes)

    @property
    def unread_steps(self) -> int:
        """Steps of its last launch, until it is read."""
        return self._unread.steps if self._unread is not None else 0

    def steps_room(self, most: int) -> int:
        """Steps (1 to `most`) its next launch may run back to back (`multi_step.py`)."""
        return steps_room(self, most)

    # ----------------------------------------------------------------- step

    def advance(self, sl: slice, new_tokens: torch.Tensor) -> None:
        """Rows `sl` drew `new_tokens` (on the device): the next step reads
        them, at the next position, with the next draw counters. The counts
        that a row which leaves keeps advance with the launch (`launched`)."""
        assert self.sampling is not None
        full = sl == slice(0, len(self.rows))
        self.kv_lens = stepped(self.kv_lens, sl, 1, full)
        (self.tokens if full else self.tokens[sl]).copy_(new_tokens)
        (self.sampling.counters if full else self.sampling.counters[sl]).add_(1)

    def launched(self, sl: slice, new_tokens: torch.Tensor, logprobs: torch.Tensor | None = None,
                 extras: dict[str, torch.Tensor] | None = None, steps: int = 1) -> Pending:
        """Rows `sl` have just been given a step that samples `new_tokens`
        (still being computed on the device), with the packed `logprobs` of
        the rows that asked; or `steps` steps, `new_tokens` [steps, n], the
        ones before the last `advance`d through already. Advances their
        state, starts the copy of the tokens (and logprobs) to the host, and
        takes out the rows that this launch brings to their write cap."""
        self.seq += 1
        full = sl == slice(0, len(self.rows))
        # the host tables advance into new tensors: the step's Pending keeps views of them, which no later step
        # writes (a window's rows or all of them: no slicing, copying or cloning when all)
        self.advance(sl, new_tokens[-1] if steps > 1 else new_tokens)
        self.counts, self.counters = stepped(self.counts, sl, steps, full), stepped(self.counters, sl, steps, full)
        if self.shape.draws is not None:
            assert self.draw_sampling is not None
            self.drawn = stepped(self.drawn, sl, self.shape.draws[1], full)
            self.draw_sampling.counters[sl] += self.shape.draws[1]
        for name, out in self.shape.carried.items():
            new = (extras or {})[self.extras[out]]
            if full:  # the step's output itself: the store holds it too, so it is never written in place
                self.carried[name] = new
            else:
                kept = self.carried[name].clone()
                kept[sl] = new
                self.carried[name] = kept
        event = None
        if new_tokens.device.type == "cuda":
            # two pinned buffers and events, used in turn: a step is read
            # before the step after next is launched
            slot = self.seq % 2
            buf = self._pinned[slot]
            if buf is None or buf.numel() < new_tokens.numel():
                buf = self._pinned[slot] = torch.empty(max(new_tokens.numel(), 256), dtype=torch.long,
                                                       pin_memory=True)
            host = buf[: new_tokens.numel()].view(new_tokens.shape)
            host.copy_(new_tokens, non_blocking=True)
            if logprobs is not None:
                # not a reused buffer: the event loop reads these after later launches
                pinned = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
                logprobs = pinned.copy_(logprobs, non_blocking=True)
            event = self._events[slot]
            event.record()
        else:
            host = new_tokens
        counts, caps, stops, kv_lens, counters, drawn = rows_of(
            (self.counts, self.caps, self.stop_table, self.kv_lens, self.counters, self.drawn), sl, full)
        exhausted = counts >= caps
        rows = self.rows[sl]
        routes = list(self._routes) if len(self._routes) == 1 else self.row_routes[sl]
        pending = Pending(self.seq, rows, self.request_ids[sl], self.partitions[sl], new_tokens, host, event, stops,
                          kv_lens, counts, counters, drawn, exhausted, logprobs, dict(extras or {}), routes,
                          self.kv_rows[sl], steps, self.followed > 0)
        self._unread = pending
        if bool(exhausted.any()):
            # valid in this step's output, gone from the next
            self._drop((exhausted.nonzero().flatten() + sl.start).tolist(), self.seq + 1)
        self.drop_held()
        return pending

    def valid_rows(self, p: Pending) -> list[int] | None:
        """Rows of `p` whose output still counts (None: all of them). A row
        taken out after launch `p.seq` (stopped, aborted, or already left on
        an earlier token) has a dead output there."""
        if not self._left_at.get(p.seq):
            return None
        return [i for i, part in enumerate(p.rows) if self._left.get(id(part), p.seq + 1) > p.seq]

    def finalize(self, p: Pending) -> list[Leave]:
        """The host has `p`'s tokens (the caller waited): the rows whose stop
        rule held at that step leave the group."""
        with self.stream.on():
            return self._finalize(p)

    def _finalize(self, p: Pending) -> list[Leave]:
        if p is self._unread:
            self._unread = None
        if p.steps > 1:
            ends = p.ends()
            hit_stop = torch.from_numpy(ends < p.steps) | (p.stop_table == p.host[-1][:, None]).any(dim=1)
            last = p.host[torch.from_numpy(ends - 1), torch.arange(len(p.rows))]
        else:
            ends, last = None, p.host.to("cpu")
            hit_stop = (p.stop_table == last[:, None]).any(dim=1)
        done = (hit_stop | p.exhausted).nonzero().flatten().tolist()
        for seq in [q for q in self._left_at if q < p.seq]:
            # rows that left before launch p.seq are in no step still to finalise
            for key in self._left_at.pop(seq):
                if self._left.get(key) == seq:
                    del self._left[key]
        out = []
        for i in done:
            part = p.rows[i]
            if part.done or self._left.get(id(part), p.seq + 1) <= p.seq:
                continue  # stopped or aborted meanwhile
            # its outputs after this step are dead (this one still counts)
            mark = max(self.seq, p.seq + 1)
            back = 0 if ends is None else p.steps - int(ends[i])  # its launch's steps after its stop
            if id(part) not in self._left:  # it stopped on a token: still in the group
                idx = next(j for j, r in enumerate(self.rows) if r is part)
                if self.outputs is not None and int(self.counters[idx]) > int(p.counters[i]) - back:
                    # a step launched after this one (the worker reads a step before launching the one after
                    # next) drew it a dead token, counted already: the counts it keeps leave that token out
                    self.outputs[idx].scatter_add_(0, self.tokens[idx].reshape(1), self.outputs.new_full((1,), -1))
                self._leave(idx, mark)
            elif self._left[id(part)] > mark:
                # taken out at a later launch for reaching its cap, but it
                # stopped on a token before: that later output is dead too
                self._left[id(part)] = mark
                self._left_at.setdefault(mark, []).append(id(part))
            self._hand_back(part, int(p.kv_lens[i]) - back, int(p.counters[i]) - back, int(p.drawn[i]))
            # the walker counts this step's write when it routes the row on
            part.set_loop_count(int(p.counts[i]) - back - 1)
            # its token from the host's copy: whatever reads it next needs no wait for this stream
            host = int(last[i])
            out.append(Leave(part, torch.tensor(host), "stop" if bool(hit_stop[i]) else "length", host, row=i))
        return out
