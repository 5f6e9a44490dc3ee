"""Where a step's outputs go, on the worker thread: to clients (staged in
the outbox, into the step's `StepReport`) and on to the rows' next steps
(the walker: their records, streams and stop rules).

An item step hands it its `StepOutput` (`route`). A decode group's launched
step is read here once its tokens land (`read_group`): the rows' tokens go
to their clients and into the streams of the rows going on, the hidden
states the step kept into the store, and the rows that left the group at
it move on in the walker.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from mstar.engine.execution.runner import StepOutput
from mstar.engine.messages import EmitBatch, StepReport
from mstar.engine.movement.arena import HostArena
from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.groups.pending import Leave, Pending, Route
from mstar.engine.worker.outbox import Outbox
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.worker.stop_rules import stop_reasons
from mstar.engine.worker.walker import Walker

if TYPE_CHECKING:
    from mstar.engine.worker.executor import WorkerStats


class Router:
    def __init__(self, walker: Walker, store: TensorStore, outbox: Outbox, arena: HostArena | None,
                 stats: WorkerStats) -> None:
        self.walker = walker
        self.store = store
        self.outbox = outbox
        self.arena = arena
        self.stats = stats

    def route(self, report: StepReport, out: StepOutput, sampled: bool = False) -> None:
        """An item step's outputs: emits (into `report`), stop rules, then every
        row moves on. `sampled`: the step's outputs are token ids [B] it sampled."""
        parts = out.parts
        reasons = stop_reasons(parts, {k: v for k, v in out.values.items() if isinstance(v, torch.Tensor)},
                               self.walker.max_model_len)
        rids = [p.request_id for p in parts]
        refs: dict[str, list[TensorRef]] = {}
        for name, data in out.values.items():
            emitting = [i for i, p in enumerate(parts) if name in p.request.walk.emits]
            if emitting:
                self.outbox.stage_rows(report, self.arena, name, data, emitting, rids, [p.name for p in parts],
                                       out.logprobs)
            if isinstance(data, list):
                refs[name] = [TensorRef(self.store.put(t, (rid,))) for t, rid in zip(data, rids)]
            else:
                handle = self.store.put(data, rids)
                refs[name] = [TensorRef(handle, i) for i in range(len(parts))]
        if out.sampled is not None:  # a mode with a signature says which of its outputs it sampled
            tokens = {name: out.values[name].tolist() for name in out.sampled}
        else:
            tokens = {name: data.tolist() for name, data in out.values.items()
                      if sampled and isinstance(data, torch.Tensor) and data.dim() == 1}
        if tokens:  # before the rows move on: a row that finishes at this step counts its token too
            report.sampled += unseen_tokens(parts, tokens)
        branches = out.branches or ["main"] * len(parts)
        for i, part in enumerate(parts):
            self.walker.completed(part, {name: rs[i] for name, rs in refs.items()}, reasons[i],
                                  {name: ids[i] for name, ids in tokens.items()}, branches[i])

    def read_group(self, report: StepReport, group: LoopGroup, p: Pending) -> float:
        """Route what `group`'s launched step `p` sampled (emits into `report`);
        returns the time spent waiting for it."""
        t0 = time.perf_counter()
        p.wait()
        waited = time.perf_counter() - t0
        host = p.host.clone()  # its pinned buffer is reused two launches on; the event loop reads later
        self.walker.streams.begin_read()
        leaving = group.finalize(p)
        valid = group.valid_rows(p)
        rows = p.rows
        keep = range(len(rows)) if valid is None else valid
        self.stats.dropped_rows += len(rows) - len(keep)
        if p.steps > 1:
            self._read_steps(report, p, host, keep, leaving)
            for leave in leaving:
                self.walker.left_group(leave, {})
            return waited
        if leaving:
            gone = {id(leave.part) for leave in leaving}
            going_on = [i for i in keep if id(rows[i]) not in gone and not rows[i].done]
        elif valid is None:  # the steady state: every row's output counts, and none left at this step
            going_on = [i for i, part in enumerate(rows) if not part.done]
        else:
            going_on = [i for i in keep if not rows[i].done]
        routes = p.route_rows()
        for route, idx in routes:  # one, unless rows of several walks stepped together
            on = set(idx) if len(routes) > 1 else None
            self._route_tokens(report, p, host, route, keep if on is None else [i for i in keep if i in on],
                               going_on if on is None else [i for i in going_on if i in on])
        if p.followed:  # rows following their ids for the prefix cache (those leaving get theirs as they go)
            ids, kv = host.tolist(), p.kv
            for i in going_on:  # every row, every step: `KVRow.sampled` without a call a row
                followed = kv[i].token_ids
                if followed is not None:
                    followed.append(ids[i])
        extras = self._group_extras(report, group, p, keep, going_on, {leave.row for leave in leaving})
        for leave in leaving:
            self.walker.left_group(leave, {name: refs[leave.row] for name, refs in extras.items()})
        return waited

    def _read_steps(self, report: StepReport, p: Pending, host: torch.Tensor, keep: range | list[int],
                    leaving: list[Leave]) -> None:
        """Route the tokens of a launch of several steps, a run of them a row:
        each row's up to and with its stop id (`Pending.ends`) to its clients,
        and into its streams those it goes on from (a row that leaves goes on
        with its last token through `Walker.left_group`)."""
        ends = p.ends().tolist()
        gone = {leave.row for leave in leaving}
        last = [end - (i in gone) for i, end in enumerate(ends)]  # steps whose token a row goes on from
        live = [i for i in keep if not p.rows[i].done]
        ids = host.t().tolist()
        routes = p.route_rows()
        for route, idx in routes:
            on = set(idx) if len(routes) > 1 else None
            counted = [i for i in keep if on is None or i in on]
            value, walk = route.value, route.walk
            if value in walk.emits and counted:  # to clients: each row's tokens, up to its stop id, in one row
                self.outbox.emit(report, EmitBatch(value, [p.request_ids[i] for i in counted],
                                                   [p.partitions[i] for i in counted],
                                                   [ids[i][:ends[i]] for i in counted]))
            elif counted:  # tokens no client sees as tokens (a codec's codes): counted where they are drawn
                report.sampled += [p.request_ids[i] for i in counted for _ in range(ends[i])]
            if walk.streams.get(value):  # into the streams: each row's run of ids in one call
                going_on = [i for i in live if last[i] and (on is None or i in on)]
                self.walker.streams.feed_ids([p.rows[i] for i in going_on], value,
                                             [ids[i][:last[i]] for i in going_on])
        if p.followed:
            for i in live:  # the prefix cache's ids; a leaving row's last one goes with it
                followed = p.kv[i].token_ids
                if followed is not None:
                    followed.extend(ids[i][:last[i]])

    def _route_tokens(self, report: StepReport, p: Pending, host: torch.Tensor, route: Route, keep: range | list[int],
                      going_on: list[int]) -> None:
        """The tokens of `p`'s rows on `route`: to the clients of the rows whose
        output counts (`keep`), and into the streams of those going on."""
        value, walk = route.value, route.walk
        every = len(keep) == len(p.rows)
        if value in walk.emits and len(keep):
            self.outbox.emit_rows(report, value, host, None if every else list(keep), p.request_ids,
                                  p.partitions, p.logprobs)
        elif len(keep):  # tokens no client sees as tokens (audio codes for a codec): counted where they are drawn
            report.sampled += p.request_ids if every else [p.request_ids[i] for i in keep]
        if going_on and walk.streams.get(value):
            items = host.tolist()  # token ids enter streams as host ints
            self.walker.streams.feed_ids([p.rows[i] for i in going_on], value, [items[i] for i in going_on])

    def _group_extras(self, report: StepReport, group: LoopGroup, p: Pending, keep: range | list[int],
                      going_on: list[int], left: set[int]) -> dict[str, list[TensorRef]]:
        """The hidden states a group step kept: stored once, emitted for the
        rows whose output counts, fed to the streams of rows that go on (by
        each row's walk), and one reference each for the rows that leave at
        it (`left`; the rest let theirs go)."""
        out: dict[str, list[TensorRef]] = {}
        if not p.extras:
            return out
        rids = p.request_ids
        walks = [(route.walk, set(idx)) for route, idx in p.route_rows()]
        for value, data in p.extras.items():
            group.stream.handed_out(data)
            emitting = [i for i in keep if any(value in w.emits and i in idx for w, idx in walks)] \
                if len(walks) > 1 else list(keep) if value in walks[0][0].emits else []
            if emitting:
                self.outbox.stage_rows(report, self.arena, value, data, emitting, rids, p.partitions)
            handle = self.store.put(data, rids)
            refs = out[value] = [TensorRef(handle, i) for i in range(len(rids))]
            for walk, idx in walks:
                if walk.streams.get(value):
                    for i in going_on:
                        if i in idx:
                            self.walker.streams.feed(p.rows[i], value, refs[i])
            for i in range(len(rids)):
                if i not in left:
                    self.store.release(refs[i], rids[i])
        return out


def unseen_tokens(parts: list[PartitionRun], tokens: dict[str, list[int]]) -> list[str]:
    """For `StepReport.sampled`: the request of each of an item step's rows
    that sampled `tokens` (by value name) none of which its walk emits, a
    token the event loop would see only in the worker's count at the end.
    A row whose partition is done already (its request aborted meanwhile)
    is left out: that count was taken before this token."""
    return [p.request_id for p in parts if not p.done and not any(name in p.request.walk.emits for name in tokens)]
