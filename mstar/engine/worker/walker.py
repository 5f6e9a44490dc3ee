"""Advances requests along their walks on one device worker.

After each step the worker hands the walker what every row wrote; the walker
moves each partition's cursor through its program (`cursor.py`): a
loop whose stop rule does not hold goes round again (its body's first step
reads the loop's value where the last round left it, on the device), a loop
whose rule holds is left, with what it collected; a stream producer's writes
are appended to its consumer's buffer and cut into chunks, fan-outs start
their branches, and a partition whose cursor passes its last step finishes.
Pages and tensor references are released as partitions finish.
"""

from __future__ import annotations

from typing import Callable

import torch

from mstar.engine.worker.cursor import Cursor
from mstar.engine.worker.groups.group_exits import GroupExits
from mstar.engine.worker.groups.joining import join_group
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.prompt_rows import PromptRow, prompt_row
from mstar.engine.messages import Finished, Submit
from mstar.engine.worker.rows import PartitionRun, RequestRun, StreamItem, Work
from mstar.engine.worker.streaming.buffer import StreamBuffer
from mstar.engine.worker.stop_rules import banned_ids, ran_out
from mstar.engine.worker.streaming.edges import Send, Streams
from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.turns import Turns
from mstar.errors import ConfigError
from mstar.graph import Component, ForkRows, Kind, Step, WalkPlan, step_bindings
from mstar.scheduler import PagePool, Scheduler, WorkItem


ENDED = ("stop", "length")  # the reasons a partition runs its course with
FORK_MODE = "@fork"  # the queue of a KV component's fork items: they change pages, so they are scheduled


def check_runnable(plans: dict[str, WalkPlan], components: dict[str, Component]) -> None:
    """Refuse, at engine start, walks that compile but that the walker cannot
    run yet: modes sampling two tokens."""
    for walk in plans.values():
        for part in walk.partitions.values():
            for step in part.steps:
                sig = components[step.component].signatures.get(step.mode)
                reason = None
                if sig is not None and sum(o.kind is Kind.TOKEN for o in sig.outputs) > 1:
                    reason = f"mode '{step.mode}' samples more than one token output: not run yet"
                if reason is not None:
                    raise ConfigError(f"walk '{walk.name}', step {step.label}: {reason}")


class Walker(GroupExits):
    def __init__(self, store: TensorStore, scheduler: Scheduler, pools: dict[str, PagePool],
                 max_model_len: int, on_finish: Callable[[Finished], None],
                 token_loops: set[str] = frozenset(), device: torch.device | None = None,
                 reservation: str = "request", join_turn: Callable[[int, list[int]], list[int]] | None = None,
                 on_awaiting: Callable[[str, int], None] | None = None, index: int = 0, send: Send | None = None,
                 components: dict[str, Component] | None = None, slots: dict[str, PagePool] | None = None,
                 min_turn_tokens: int = 1) -> None:
        """`token_loops`: KV components that sample; their decode loops run
        as `LoopGroup`s on `device`. `reservation` (`--kv-reservation`):
        which rows' first steps take pages for their prompt only, a group row
        getting more as it grows (the scheduler's `StepPlan.grow`), instead of
        all of them up front (`grows`).
        `join_turn`, `on_awaiting`, `min_turn_tokens`: see `Turns`. `index`: this worker's
        place among the engine's workers; `send`: to another worker (see
        `Streams`); `components`: the model's, for the signatures of their
        modes."""
        self.store = store
        self.scheduler = scheduler
        self.pools = pools
        self.max_model_len = max_model_len
        self.on_finish = on_finish
        self.token_loops = token_loops
        self.device = device or torch.device("cpu")
        self.reservation = reservation
        self.components = components or {}
        self.slots = slots or {}  # the free state slots of components with per-row state
        self.runs: dict[str, RequestRun] = {}
        self.groups: dict[tuple, LoopGroup] = {}  # by component, mode and what a step reads and keeps
        self.group_streams: dict[str, torch.cuda.Stream] = {}  # on CUDA, per component: its groups' steps
        self.index = index
        self.cursor = Cursor(self)
        self.turns = Turns(self, join_turn, on_awaiting, min_turn_tokens)
        self.streams = Streams(self, send)
        scheduler.cuts_next = self.streams.cuts_next  # a first chunk leads only where it costs no extra step

    # --------------------------------------------------------------- start

    def start(self, sub: Submit) -> None:
        """Start the request's partitions that run here (all of them unless
        `sub.places` puts some on other workers)."""
        places = sub.places or {}
        turns = sub.more_input and sub.walk.more_input is not None
        run = RequestRun(sub.request_id, sub.walk, sub.sampling, sub.stop_ids, input_open=turns, places=places,
                         priority=sub.priority, takes_turns=turns, entering=True)
        self.runs[run.request_id] = run
        here = [name for name in sub.walk.partitions if places.get(name, self.index) == self.index]
        for name in here:
            if sub.walk.partitions[name].stream is not None:
                self._add_partition(run, name)
        if sub.walk.root not in here:
            run.entering = False  # its producers run elsewhere and feed these consumers through `Streams`
            return
        root = self._add_partition(run, sub.walk.root)
        rid = run.request_id
        for name, tensor in sub.values.items():
            root.values[name] = TensorRef(self.store.put(tensor, (rid,)))
        self.fork(root, 0)
        self.advance(root)
        run.entering = False  # what it queues from now on (a talker's row, a resumed one) is no new request's

    def _add_partition(self, run: RequestRun, name: str) -> PartitionRun:
        part = PartitionRun(run, run.walk.partitions[name])
        if part.plan.stream is not None:  # a consumer waits for its stream's first item to start
            part.inbox = StreamBuffer(part.plan.stream)
            part.parked = True
        run.partitions[name] = part
        run.live += 1
        return part

    def fork(self, part: PartitionRun, at: int) -> None:
        """Start the fan-out branches that start when `part`'s cursor reaches `at`."""
        for name in part.request.walk.forks.get((part.name, at), ()):
            branch = self._add_partition(part.request, name)
            for value, ref in part.values.items():
                self.store.retain(ref, part.request_id)
                branch.values[value] = ref
            self.advance(branch)

    # ------------------------------------------------------------ queueing

    def advance(self, part: PartitionRun) -> None:
        """Queue the step under the cursor, or finish the partition."""
        if part.done:
            return
        self.cursor.settle(part)
        program = part.plan.program
        if part.pc < len(program) and isinstance(program[part.pc], ForkRows):
            self._fork_rows(part, program[part.pc])
            return
        ins = part.instr()
        if ins is None:
            again = self.streams.next_pass(part) if part.inbox is not None else None
            if again:
                self.advance(part)
            elif again is None:
                self.finish(part, part.request.root_reason or "stop")
            return
        if ins.enters and (not part.loops or part.loops[-1].loop != ins.checks):
            assert ins.checks is not None
            self.cursor.push(part, ins.checks)  # the loop starts with this step's write
        if ins.checks is not None and join_group(self, part, ins):
            return
        inputs: dict[str, TensorRef | list[StreamItem] | int] = {}
        stream = part.plan.stream
        leads = False
        if stream is not None and stream.as_ in ins.step.inputs:
            chunk = self.streams.read(part)
            if chunk is None:
                return  # parked until a chunk is cut, or the stream is over
            inputs[stream.as_], index = chunk
            leads = index == 0
            if "@chunk" in ins.step.inputs:
                inputs["@chunk"] = index
            for name in ins.step.outputs:  # a seeded consumer draws by its chunk's place in the segment
                part.writes[name] = index
        joins = dict(ins.joins)
        for n in ins.step.inputs:
            if n not in inputs:
                inputs[n] = (part.loops[ins.depth - 1].iteration if n == "@i" else
                             [part.values[f"{n}@{b}"] for b in joins[n]] if n in joins else part.values[n])
        if not ins.branches:
            self.enqueue(part, ins.step, inputs, leads=leads)
            return
        part.outstanding = len(ins.branches)
        for branch in ins.branches:  # one row each, queued together: they share the step
            self.enqueue(part, ins.step, {n: part.values[f"{n}@{branch}"] if n in ins.own else ref
                                          for n, ref in inputs.items()}, branch, leads=leads)

    def _fork_rows(self, part: PartitionRun, fork: ForkRows) -> None:
        """Queue the split of `part`'s KV row: a page for each shared branch's
        copy of main's partial last page, granted by the scheduler (and, for
        a main row preempted meanwhile, the pages its KV comes back into)."""
        main = part.row(fork.component)
        pool = self.pools[fork.component]
        shares = sum(how == "share" for _, how in fork.fork.branches)
        swapped = main.swapped.num_pages if main.swapped is not None else 0  # preempted: its KV comes back first
        pages = (shares if (main.pages or swapped) and main.kv_len % pool.page_size else 0) + swapped
        part.busy = True
        self.scheduler.add(WorkItem(part.request_id, part.name, fork.component, FORK_MODE, 0, pages,
                                    payload=Work(part, {}), starts_row=bool(swapped), capped=False))

    def forked(self, part: PartitionRun) -> None:
        """`part`'s KV row is split into its branches: on past the fork."""
        part.busy = False
        self.cursor.move(part, part.pc + 1)
        self.advance(part)

    # ------------------------------------------------------------ queueing

    def enqueue(self, part: PartitionRun, step: Step, inputs: dict[str, TensorRef | list[StreamItem] | int],
                branch: str = "main", leads: bool = False) -> None:
        """Queue `part`'s `step` with `inputs`; `leads`: it reads the first
        chunk of its stream's turn (`WorkItem.leads`)."""
        rid = part.request_id
        pool = self.pools.get(step.component)
        num_tokens, pages, starts_row, capped, prompt = 1, 0, False, branch == "main", PromptRow()
        if pool is not None:
            row = part.row(step.component, branch)
            num_tokens = self._num_tokens(step, inputs)
            sig = self.components[step.component].signatures.get(step.mode) if self.components else None
            total = (0 if sig is not None and sig.reset else row.kv_len) + num_tokens
            if total > self.max_model_len and not part.done:
                # a loop whose budget was not fitted to the context (a talker's, not the root's) ends at its edge
                self.finish(part, "length")
                return
            if (not row.pages and row.swapped is None) or part.pc == 0:  # the row's first step, or a later turn's
                total += self._reserve(part, row, total)
            pages = max(0, pool.pages_for(min(total, self.max_model_len)) - len(row.pages))
            if row.swapped is not None:  # preempted while it waited: its KV comes back into pages first
                pages, capped = max(pages, row.swapped.num_pages), False  # it ran already: the cap is for new rows
            starts_row = not row.pages
            prompt = prompt_row(self.store, self.components.get(step.component), step, inputs, row, pool.page_size,
                                step.component in self.scheduler.caches, pool.token_rows)
            if prompt.tokens is not None and self._follows(part) and (ids := prompt.ids()):
                row.follow(ids)
            elif row.token_ids is not None and not self._loops_back(part, step):
                row.unfollow()
        for refs in inputs.values():
            for ref in refs if isinstance(refs, list) else (refs,):
                if type(ref) is not int:  # a stored item (token ids on the host hold nothing)
                    self.store.retain(ref, rid)
        # a row of a component with per-row state takes a slot at its first step (a plain one too: no pages)
        needs_slot = step.component in self.slots and part.row(step.component, branch).slot is None
        part.busy = True
        banned = banned_ids(part) if step.component in self.token_loops else ()
        self.scheduler.add(WorkItem(rid, part.name, step.component, step.mode, num_tokens, pages,
                                    payload=Work(part, inputs, branch, banned=banned), starts_row=starts_row,
                                    needs_slot=needs_slot, capped=capped, prefix=prompt.prefix,
                                    chunkable=prompt.chunkable, priority=part.request.priority,
                                    new_request=starts_row and part.request.entering,
                                    first_step=part.request.entering, leads=leads))

    @staticmethod
    def _follows(part: PartitionRun) -> bool:
        """Whether a row whose first step is under `part`'s cursor follows its
        ids for the prefix cache: its step enters a token loop whose tokens
        the client reads back in a later prompt (a conversation's turns), not
        ones another partition's stream takes (speech codes), in a request
        without later turns of its own."""
        ins = part.instr()
        if ins is None or ins.checks is None or part.request.walk.more_input is not None:
            return False
        return not part.request.walk.streams.get(part.plan.loops[ins.checks].loop.value)

    @staticmethod
    def _loops_back(part: PartitionRun, step: Step) -> bool:
        """`step` reads back its loop's last token (item by item, outside a group)."""
        ins = part.instr()
        return ins is not None and ins.checks is not None and \
            step.inputs[:1] == (part.plan.loops[ins.checks].loop.value,)

    def _num_tokens(self, step: Step, inputs: dict[str, TensorRef | list[StreamItem] | int]) -> int:
        """The new tokens a KV step brings: its query input's ids, or its rows
        of embeddings; a name-only mode's first input is its ids."""
        comp = self.components.get(step.component)
        sig = comp.signatures.get(step.mode) if comp is not None else None
        if sig is None:
            first = inputs[step.inputs[0]]
            assert isinstance(first, TensorRef)
            return self.store.numel(first)
        assert sig.query is not None
        query = inputs[step_bindings(step, sig)[0][sig.query]]
        if isinstance(query, list):  # stream items, one token each
            return len(query)
        if sig.input(sig.query).kind is Kind.EMBEDS:
            return self.store.get(query).shape[0]
        return self.store.numel(query)

    def _reserve(self, part: PartitionRun, row: KVRow, tokens: int) -> int:
        """Tokens a KV partition will append after its first step (of
        `tokens`): the cap of the loop that step enters, so admission
        reserves the whole request once; none for a row that takes its pages
        as it goes: every row with lazy reservation; with auto, every row but
        one whose first step enters a loop with a cap that leaves some of the
        context (a request with `max_tokens`), in a request that takes no
        turns (a turn's row holds the turns before it and asks for more)."""
        ins = part.instr()
        cap = part.loops[-1].cap if ins is not None and ins.enters else None
        bounded = cap is not None and tokens + cap < self.max_model_len and not part.request.takes_turns
        grows = self.reservation == "lazy" or (self.reservation == "auto" and not bounded)
        row.takes_pages(grows)
        return 0 if grows else cap or 0

    def cancel(self, items: list[WorkItem]) -> None:
        """Release what queued items hold (they will never run)."""
        for item in items:
            part, inputs = item.payload.part, item.payload.inputs
            part.busy = False
            for refs in inputs.values():
                for ref in refs if isinstance(refs, list) else (refs,):
                    self.streams.release(ref, item.request_id)

    # --------------------------------------------------------- completion

    def completed(self, part: PartitionRun, outputs: dict[str, TensorRef], reason: str | None,
                  tokens: dict[str, int] | None = None, branch: str = "main") -> None:
        """Row `part` (its `branch` row, in an `Each`) of a finished step wrote
        `outputs` (one reference each, owned by its request); move the
        partition on once every branch row of the step has. `reason`: the
        stop rule of the loop judging the step held ("stop", "length").
        `tokens`: the sampled token ids among the outputs, already on the
        host; streams take those as ints, like the tokens of a loop group."""
        if part.done:
            part.busy = False
            for ref in outputs.values():
                self.store.release(ref, part.request_id)
            return
        ins = part.instr()
        if ins is not None and ins.branches:
            for name, ref in outputs.items():
                self.cursor.write(part, f"{name}@{branch}", ref, None)
            part.outstanding -= 1
            if part.outstanding:
                return  # its other branch rows are still on their way
        else:
            for name, ref in outputs.items():
                self.cursor.record(part, name, ref)
            for name, ref in outputs.items():
                token = tokens.get(name) if tokens else None
                self.streams.feed(part, name, token if token is not None else ref)
            if tokens and ins is not None and ins.step.component in self.pools:
                row = part.rows.get((ins.step.component, branch))
                for name in ins.step.outputs:
                    if row is not None and name in tokens:
                        row.sampled(tokens[name])
        part.busy = False
        if part.plan.stream is not None and ins is not None and part.plan.stream.as_ in ins.step.inputs:
            self.streams.consumed(part)
        if reason is not None and ins is not None and ins.checks is not None:
            top = part.loops[0].loop == ins.checks  # a top-level loop ends a turn, or the partition's work
            loop = part.plan.loops[ins.checks].loop
            frame = part.frame(ins.checks)
            if reason == "length" and frame is not None and ran_out(part, loop, frame):
                part.request.cut = True  # a spoken answer's frames cut by max_tokens, though its text ended
            if top and self.turns.ends_turn(part, reason):
                self.turns.end(part, loop, reason, tokens.get(loop.value) if tokens else None)
                return
            if top and part.plan.parent is None and part.plan.stream is None:  # the root's, not a consumer's
                part.request.root_reason = reason
            self.cursor.exit(part, ins.checks)
        else:
            self.cursor.move(part, part.pc + 1)
        self.advance(part)

    # ---------------------------------------------------------- finishing

    def finish(self, part: PartitionRun, reason: str, error: str | None = None) -> None:
        if part.done:
            return
        part.done = True
        run = part.request
        rid = run.request_id
        if part.plan.parent is None and part.plan.stream is None and run.root_reason is None:
            run.root_reason = reason
        self.cursor.restart(part, part.pc)
        for ref in part.values.values():
            self.store.release(ref, rid)
        part.values.clear()
        if part.inbox is not None:
            self.streams.forget(part)
            for ref in part.inbox.clear():
                self.streams.release(ref, rid)
        self.free_pages(part)
        run.live -= 1
        self.streams.close(part)
        done = run.live == 0
        if done:
            self.runs.pop(rid, None)
            if not run.shared:  # other workers' parts of the request still hold references (the engine drops them)
                self.store.drop_owner(rid)
        generated = {name: sum(r.generated for r in p.rows.values()) for name, p in run.partitions.items()} \
            if done else {}
        if done and reason in ENDED and (run.cut or run.root_reason in ENDED):
            # a request that ran its course ended as its root did (a spoken answer's text), unless a budget cut
            # it (known here even when this worker's part ended before the root's end reached it)
            reason = "length" if run.cut else run.root_reason
        self.on_finish(Finished(rid, part.name, reason, done, error, generated))

    def free_pages(self, part: PartitionRun) -> None:
        """Give the partition's KV pages back; its rows no longer run. A row
        that followed its ids hands its full pages to the prefix cache first
        (what it generated too: a conversation's next turn starts with it)."""
        for row in part.rows.values():
            pool = self.pools.get(row.component)
            if row.token_ids is not None and pool is not None:
                ids, pages = row.full_pages(pool.page_size)
                self.scheduler.cache_pages(row.component, ids, pages)
            if row.release(pool, self.slots.get(row.component)):
                self.scheduler.row_ended(row.component)

    def stop(self, request_id: str, partition: str) -> int:
        """The event loop stopped a partition: cancel its queued work and
        finish it. Returns how many queued steps were cancelled."""
        run = self.runs.get(request_id)
        part = run.partitions.get(partition) if run else None
        if part is None or part.done:
            return 0
        cancelled = self.scheduler.remove(request_id, partition)
        self.cancel(cancelled)
        grouped = self._take_out_of_groups(request_id, partition)
        if part.plan.parent is None:
            run.root_reason = run.root_reason or "stop"
        self.finish(part, "stop")
        return len(cancelled) + grouped

    def unstarted(self, request_ids: frozenset[str]) -> set[str]:
        """Of `request_ids`, those queued to start whose rows here never ran:
        none holds pages, swapped KV or a state slot, or has sampled."""
        out = set()
        for rid in self.scheduler.starting() & request_ids:
            run = self.runs.get(rid)
            if run is None:
                continue
            rows = [row for part in run.partitions.values() for row in part.rows.values()]
            if all(not row.pages and row.swapped is None and row.slot is None and not row.generated for row in rows):
                out.add(rid)
        return out

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> int:
        """Tear a whole request down; returns how many queued steps it had."""
        run = self.runs.get(request_id)
        if run is None:
            return 0
        cancelled = self.scheduler.remove(request_id)
        self.cancel(cancelled)
        grouped = self._take_out_of_groups(request_id, None, count_sampled=True)
        run.root_reason = reason
        parts = [p for p in run.partitions.values() if not p.done]
        for p in parts:
            if p.inbox is not None:
                p.inbox.pending.clear()
                p.inbox.closed = True
        for p in parts:
            self.finish(p, reason, error)
        return len(cancelled) + grouped
