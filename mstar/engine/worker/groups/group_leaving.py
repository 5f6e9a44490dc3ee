"""Rows leaving a decode group: taken out (a stop or an abort), evicted with
their state exact (preempted, or waiting for their stream), or dropped once
their loop stops; what each hands back to its KV row, and after which launch
its outputs stop counting.
"""

from __future__ import annotations

import torch

from mstar.engine.movement.transfer import to_device
from mstar.engine.worker.groups.group_shape import GroupShape
from mstar.engine.worker.groups.group_stream import GroupStream
from mstar.engine.worker.groups.group_tables import GroupTables
from mstar.engine.worker.groups.pending import Leave, Pending, Route
from mstar.engine.worker.rows import PartitionRun


class GroupLeaving(GroupTables):
    """The leaving side of a `LoopGroup`: what rows take with them, and the
    marks that make a launched step's output of a gone row dead."""

    component: str
    stream: GroupStream
    shape: GroupShape
    seq: int
    followed: int
    _routes: dict[Route, int]
    row_routes: list[Route]
    _left: dict[int, int]
    _left_at: dict[int, list[int]]
    _unread: Pending | None
    _held: list[PartitionRun] | None

    def take_out(self, request_id: str, partition: str | None, count_sampled: bool = False) -> list[Leave]:
        """Remove a request's rows (of one partition, or all) without a step.
        `count_sampled` (an abort): the rows count every token they sampled,
        steps in flight included, as what the request cost; a stop counts
        only what the event loop has taken in."""
        with self.stream.on():
            return self._take_out(request_id, partition, count_sampled)

    def _take_out(self, request_id: str, partition: str | None, count_sampled: bool) -> list[Leave]:
        out = []
        for j in [j for j in self._joins if j.part.request_id == request_id
                  and (partition is None or j.part.name == partition)]:
            self._joins.remove(j)
            out.append(Leave(j.part, j.token, None))
        idx = [i for i, (r, p) in enumerate(zip(self.request_ids, self.partitions))
               if r == request_id and (partition is None or p == partition)]
        for i in idx:
            if count_sampled:
                back = self._after_stop(self.rows[i])
                self._hand_back(self.rows[i], int(self.kv_lens[i]) - back, int(self.counters[i]) - back,
                                int(self.drawn[i]))
            out.append(Leave(self.rows[i], self.tokens[i].clone(), None))
        if self._held is None:
            self._drop(idx, self.seq)
        else:  # a launch under way steps them on, for nothing, until it is launched
            for i in idx:
                self._leave(i, self.seq)
        return out

    def _after_stop(self, part: PartitionRun) -> int:
        """Steps of the last launch, still unread, that `part` ran past its
        stop id (what it drew there is not its own): 0 unless that launch ran
        several steps. Reading them waits for it."""
        p = self._unread
        if p is None or p.steps == 1 or p.seq != self.seq:
            return 0
        j = next((j for j, row in enumerate(p.rows) if row is part), None)
        if j is None:
            return 0
        p.wait()
        return p.steps - int(p.ends()[j])

    def evict(self, i: int, reason: str = "preempt") -> Leave:
        """Take row `i` out with its state exact, to be resumed later (the
        caller has read every launched step: nothing of the row is in
        flight). Its pages stay in its list, for the caller to swap out
        (preempted), or keep (a row waiting for its stream's next item)."""
        part = self.rows[i]
        self._hand_back(part, int(self.kv_lens[i]), int(self.counters[i]), int(self.drawn[i]))
        part.set_loop_count(int(self.counts[i]))
        with self.stream.on():
            token = self.stream.handed_out(self.tokens[i].clone())
            carried = {self.shape.extras[out]: self.stream.handed_out(self.carried[name][i].clone())
                       for name, out in self.shape.carried.items()}
            self._drop([i], self.seq)
        self.stream.worker_waits()  # what it hands back is read there next
        return Leave(part, token, reason, carried=carried)

    def _hand_back(self, part: PartitionRun, kv_len: int, generated: int, drawn: int) -> None:
        key = self.shape.draws[0] if self.shape.draws is not None else None
        part.row(self.component).back_from_group(kv_len, generated, None if key is None else (key, drawn))

    def hold_drops(self) -> None:
        """A launch of several steps is under way and the launch before it is
        read now: rows that stop there stay in the tensors, stepping on for
        nothing, until this launch's steps are all launched (`drop_held`)."""
        self._held = []

    def drop_held(self) -> None:
        """Drop the rows that left while a launch was under way."""
        held, self._held = self._held, None
        if held:
            gone = {id(part) for part in held}
            self._drop([i for i, part in enumerate(self.rows) if id(part) in gone], self.seq)

    def _leave(self, idx: int, mark: int) -> None:
        """Row `idx` stopped: gone after launch `mark`, from the tensors now or once the launch under way is."""
        if self._held is None:
            self._drop([idx], mark)
            return
        part = self.rows[idx]
        self._left[id(part)] = mark
        self._left_at.setdefault(mark, []).append(id(part))
        self._held.append(part)

    def _drop(self, idx: list[int], seq: int) -> None:
        """Remove rows from the tensors; they count as gone after launch `seq`
        (or the earlier launch they were marked gone after)."""
        if not idx:
            return
        for i in idx:
            part, kv = self.rows[i], self.kv_rows[i]
            self._left[id(part)] = min(self._left.get(id(part), seq), seq)
            self.followed -= kv.token_ids is not None
            route = self.row_routes[i]
            self._routes[route] -= 1
            if not self._routes[route]:
                del self._routes[route]
            if self.seen is not None:
                kv.keep_seen(self.stream.handed_out(self.seen[i].clone()))
            if self.outputs is not None and part.sampling.penalises_outputs:
                kv.keep_outputs(self.stream.handed_out(self.outputs[i].clone()))
        self._left_at.setdefault(seq, []).extend(id(self.rows[i]) for i in idx)
        keep = torch.ones(len(self.rows), dtype=torch.bool)
        keep[idx] = False
        kept = keep.nonzero().flatten()
        gone = set(idx)
        self.rows = [r for i, r in enumerate(self.rows) if i not in gone]
        self.kv_rows = [r for i, r in enumerate(self.kv_rows) if i not in gone]
        self.row_routes = [r for i, r in enumerate(self.row_routes) if i not in gone]
        self.request_ids = [r.request_id for r in self.rows]
        self.partitions = [r.name for r in self.rows]
        dev_kept = to_device(kept, self.device)
        self.tokens = self.tokens[dev_kept]
        self.kv_lens, self.counts, self.caps = self.kv_lens[kept], self.counts[kept], self.caps[kept]
        self.counters, self.slots, self.deltas = self.counters[kept], self.slots[kept], self.deltas[kept]
        self.block_table, self.stop_table = self.block_table[kept], self.stop_table[kept]
        self.page_counts = self.page_counts[kept]
        self.drawn, self.mins = self.drawn[kept], self.mins[kept]
        self.carried = {name: t[dev_kept] for name, t in self.carried.items()}
        if self.live is not None:
            self.live, self.stop_ids = self.live[dev_kept], self.stop_ids[dev_kept]
        if not self.rows:  # start afresh: no flags or penalty rows linger
            self.sampling, self.seen, self.draw_sampling, self.outputs = None, None, None, None
        if self.sampling is not None:
            self.sampling = self.sampling.select(dev_kept, kept)
        if self.draw_sampling is not None:
            self.draw_sampling = self.draw_sampling.select(dev_kept, kept)
        if self.seen is not None:
            self.seen = self.seen[dev_kept]
        if self.outputs is not None:  # kept while a row penalises its outputs: else each join copies it
            penalised = self.sampling is not None and self.sampling.any_output_penalty
            self.outputs = self.outputs[dev_kept] if penalised else None
