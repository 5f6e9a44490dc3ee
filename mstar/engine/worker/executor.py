"""Carries out the scheduler's step plans on the worker thread: a `StepPlan`
in, a step on the device and its outputs handed to the `Router` (into the
step's `StepReport`).

A plan runs in this order: settle (read every launched group step), preempt
(swap group rows out), grow (hand group rows their new pages), admit (rows
take the pages they were admitted with), resume (preempted rows swap back
in and rejoin their group), run. It decides nothing the plan does not say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import structlog
import torch

from mstar.engine.execution.runner import ComponentRunner
from mstar.engine.messages import Awaiting, Finished, StepReport
from mstar.engine.movement.arena import HostArena
from mstar.engine.movement.tensor_store import TensorStore
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.groups.pending import Pending
from mstar.engine.worker.forking import fork_rows
from mstar.engine.worker.groups.mixed_items import MixedItems
from mstar.engine.worker.outbox import Outbox
from mstar.engine.worker.streaming.peer_link import PeerLink
from mstar.engine.worker.preemption import Preemption
from mstar.engine.worker.profiling import ranged
from mstar.engine.worker.router import Router
from mstar.engine.worker.walker import FORK_MODE, Walker
from mstar.scheduler import Batch, Scheduler, StepPlan, WorkItem

log = structlog.get_logger("mstar.worker")


@dataclass
class WorkerStats:
    steps: int = 0
    rows: int = 0
    cancelled_steps: int = 0  # queued steps a late stop cancelled
    dropped_rows: int = 0     # rows of launched decode steps whose output was dead (stopped a step before)
    # seconds spent per phase of a decode group step, summed (host profile)
    wait_s: float = 0.0       # blocked on the device for the previous step
    launch_s: float = 0.0     # planning, graph replay, sampling launch, group bookkeeping
    finalize_s: float = 0.0   # reading the previous step: stop rules, emits, routing
    # the worker thread's CPU time in launch and finalize (device waits included): what wall time adds
    # beyond it is time the thread could not run (the GIL held by another thread, or the OS)
    launch_cpu_s: float = 0.0
    finalize_cpu_s: float = 0.0
    failed_steps: int = 0
    mixed_steps: int = 0       # group steps that took new rows' prompt tokens in
    mixed_graph_steps: int = 0  # of those, replayed as CUDA graphs
    mixed_rows: int = 0        # new rows those steps took in
    mixed_s: float = 0.0       # reading the new rows' tokens (a wait for their step) and routing them


class Executor:
    def __init__(self, name: str, device: torch.device, runners: dict[str, ComponentRunner], walker: Walker,
                 scheduler: Scheduler, store: TensorStore, link: PeerLink, post: Callable[[StepReport], None],
                 arena: HostArena | None, preemption: Preemption | None, stats: WorkerStats,
                 arriving: Callable[[], bool] = lambda: False) -> None:
        """`post`: hands a step's report to the event loop; `preemption`:
        swaps rows out and in (None unless pages are reserved lazily);
        `arriving`: new requests wait in the worker's inbox (a launch of
        several steps then ends at the step it has queued)."""
        self.name = name
        self.device = device
        self.runners = runners
        self.walker = walker
        self.scheduler = scheduler
        self.link = link
        self.post = post
        self.preemption = preemption
        self.stats = stats
        self.arriving = arriving
        self.outbox = Outbox()
        self.router = Router(walker, store, self.outbox, arena, stats)
        self.report = StepReport(device=name)   # of the step under way, posted by `flush`
        self._inflight: dict[LoopGroup, Pending] = {}  # launched group steps not read yet
        self._group_mark: dict[LoopGroup, float] = {}   # when each group's last step was done

    @property
    def in_flight(self) -> bool:
        """Launched group steps not read yet."""
        return bool(self._inflight)

    # --------------------------------------------------------------- plans

    def next_plan(self) -> StepPlan | None:
        """The scheduler's next plan with work in it (None: no queue can move
        on). A plan that only asks for a settle is carried out here, and the
        scheduler asked again: it then sees nothing in flight."""
        while True:
            self._merge_joins()
            plan = self.scheduler.schedule(in_flight=bool(self._inflight))
            if (plan is None and self.preemption is not None and not self._inflight and self.scheduler.has_work()
                    and not self.scheduler.held_back):
                if self.preemption.unstick(self.scheduler):
                    continue  # a waiting row gave its pages back: the others may move on
            if plan is None or plan.has_work:
                return plan
            self.settle()

    def run(self, plan: StepPlan) -> None:
        if plan.settle:
            self.settle()
            # a KV step reads rows (pages, seen tokens) and graph buffers the groups' streams last wrote
            for group in self.walker.groups.values():
                group.stream.worker_waits()
        if plan.group is not None:
            self._run_group(plan)
        else:
            self._step(Batch(plan.component, plan.mode, plan.items))
        self._read_emptied()

    def _read_emptied(self) -> None:
        """Read the launched step of each group no row is left in: no later
        step of its own would, and its rows' last tokens would wait for the
        next settle (while other groups step, that may be seconds away)."""
        for group in [g for g in self._inflight if not len(g)]:
            self._read(group)

    def _merge_joins(self) -> None:
        """Fold rows that joined a group into it, so that the scheduler plans
        on every row; rows that cannot join fail."""
        for group in tuple(self.walker.groups.values()):
            try:
                group.merge()
            except Exception as e:  # their prefill built the same tensors: this is not expected
                log.exception("rows could not join their decode group", device=self.name,
                              component=group.component)
                for rid in dict.fromkeys(group.joining()):
                    self.walker.abort(rid, "error", f"{type(e).__name__}: {e}")

    # ---------------------------------------------------------- item steps

    def _step(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        if batch.mode == FORK_MODE:
            self._fork(batch)
            return
        runner = self.runners[batch.component]
        if runner.stream is None:
            self._take_and_run(batch, runner, t0)
            return
        # its own stream: after what the worker's stream has queued (the inputs' producers), and
        # beside what it queues next; the outputs only reach clients, through events of this stream
        runner.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(runner.stream):
            self._take_and_run(batch, runner, t0)

    def _admit(self, items: list[WorkItem], runner: ComponentRunner) -> list[WorkItem]:
        """Rows take the pages (and slots) they were admitted with; the
        preempted among them come back. The items that run a step."""
        for item in items:
            if not item.granted and item.granted_slot is None:
                continue
            row = item.payload.part.row(item.component, item.payload.branch)
            if item.granted:  # pages the scheduler admitted the row with: the row owns them now
                row.admit(item.granted, item.cached_tokens)
                item.granted, item.cached_tokens = [], 0
            if item.granted_slot is not None:  # and its slot of per-row state, which starts empty
                assert runner.state is not None
                row.take_slot(item.granted_slot)
                runner.state.zero(item.granted_slot)
                item.granted_slot = None
        return items if self.preemption is None else self.preemption.resume(items)

    def _take_and_run(self, batch: Batch, runner: ComponentRunner, t0: float) -> None:
        batch.items = self._admit(batch.items, runner)
        if not batch.items:
            return
        groups = runner.by_writes(batch)
        if len(groups) > 1:  # rows whose walks name the mode's outputs differently: one call each way
            for items in groups:
                self._run(Batch(batch.component, batch.mode, items), runner, time.perf_counter())
            return
        self._run(batch, runner, t0)

    def _run(self, batch: Batch, runner: ComponentRunner, t0: float) -> None:
        self._started(batch.items, t0)
        inputs: list[dict[str, torch.Tensor]] | None = None
        try:
            inputs = runner.take_inputs(batch)
            with torch.profiler.record_function(f"mstar.{batch.component}.{batch.mode}"):
                out = runner.compute(batch, inputs)
        except Exception as e:
            self.stats.failed_steps += 1
            log.exception("step failed", device=self.name, component=batch.component, mode=batch.mode,
                          rows=len(batch))
            if inputs is None or len(batch) == 1 or runner.state is not None:
                # rows of per-row state may be half updated in place: none of them can run again
                self._fail(batch, f"{type(e).__name__}: {e}")
            else:
                self._retry_alone(batch, inputs)
            return
        self._chunked(batch.items, inputs)
        if out.parts:
            with torch.profiler.record_function("mstar.route"):
                # a sampling step has waited for its tokens already: reading them costs no wait
                self.router.route(self.report, out, sampled=runner.spec.samples)
        self.stats.steps += 1
        self.stats.rows += len(batch)
        r = self.report
        r.component, r.mode, r.rows = batch.component, batch.mode, len(batch)
        r.step_s = time.perf_counter() - t0
        r.device_s = self.runners[batch.component].device_s

    def _started(self, items: list[WorkItem], t0: float) -> None:
        """Tell the event loop which of `items` start a just-submitted
        request's work (`WorkItem.first_step`: its first prompt chunk, or a
        media encoder's step that comes before it) in the step that began at
        `t0`: its queue time ends there, its prefill time starts."""
        self.report.started += [(item.request_id, t0) for item in items if item.first_step]

    def _fork(self, batch: Batch) -> None:
        cache = self.runners[batch.component].kv
        assert cache is not None
        fork_rows(batch, cache, self.scheduler, self.walker, self.preemption)
        self.stats.steps += 1
        self.stats.rows += len(batch)

    def _fail(self, batch: Batch, error: str) -> None:
        for item in batch.items:
            item.payload.part.busy = False
            self.walker.abort(item.request_id, "error", error)

    def _retry_alone(self, batch: Batch, inputs: list[dict[str, torch.Tensor]]) -> None:
        """A step of several rows failed: run each row on its own, so that a
        row whose input breaks the step fails alone and its neighbours go on."""
        runner = self.runners[batch.component]
        for item, row in zip(batch.items, inputs):
            alone = Batch(batch.component, batch.mode, [item])
            try:
                out = runner.compute(alone, [row])
            except Exception as e:
                log.warning("row failed on its own", device=self.name, request_id=item.request_id, error=repr(e))
                self._fail(alone, f"{type(e).__name__}: {e}")
            else:
                self._chunked([item], [row])
                if out.parts:
                    self.router.route(self.report, out, sampled=runner.spec.samples)

    def _chunked(self, items: list[WorkItem], inputs: list[dict[str, torch.Tensor]]) -> None:
        """After a step ran: a row with chunks to come goes back in line with
        its inputs; a row whose prompt is whole in its pages now (in stream
        order) puts its full pages in the prefix cache."""
        for item, row in zip(items, inputs):
            if item.partial:
                # its inputs left the store with this step: what a cancel would release is gone
                item.payload.held, item.payload.inputs = row, {}
                self.scheduler.next_chunk(item)
            elif item.prefix:
                self.scheduler.cache_prefix(item, item.payload.part.row(item.component, item.payload.branch).pages)

    # --------------------------------------------------------- group steps

    def _run_group(self, plan: StepPlan) -> None:
        """Launch the next decode step of a token loop group, then read the
        previous one's tokens while the device computes: the host work of a
        step (stop rules, emits, routing, the report) overlaps the next step,
        and on CUDA the next step is prepared while the previous one runs.
        No per-row work but for rows that stop (and rows feeding a stream)."""
        group, sl = plan.group, plan.rows
        assert isinstance(group, LoopGroup) and sl is not None
        if plan.preempt:
            assert self.preemption is not None
            self.preemption.swap_out(group, plan.preempt)
        group.add_pages(plan.grow)
        if group.shape.fed is not None:
            sl = self._fed_window(group, sl)
        runner = self.runners[group.component]
        prev = self._inflight.get(group)
        t0, c0 = time.perf_counter(), time.thread_time()
        n = sl.stop - sl.start
        launched: Pending | None = None
        device = 0.0  # on CUDA the runner only waited for the step before's inputs; on the CPU it computed
        mixed = self._take_mixed(plan, runner)
        if mixed is not None:  # the new rows only: the group's running rows are no request's first step
            self._started(mixed.items, t0)
        steps = plan.steps if mixed is None else 1
        # new rows whose mixed step failed, with their inputs: each runs again on its own
        broke: tuple[Batch, list[dict[str, torch.Tensor]]] | None = None
        early: list[float] = []  # the launch before, read inside a launch of several steps: its wait and wall time
        if n:
            try:
                fed = self.walker.streams.take_items(group.rows[sl]) if group.shape.fed is not None else None
                if steps > 1:
                    launched, device = self._launch_steps(group, sl, runner, steps, prev, early)
                    steps = launched.steps
                else:
                    with ranged(f"mstar.{group.component}.{group.mode}"), group.stream.on():
                        group.stream.after_worker()
                        try:
                            launch = runner.run_group(group, sl, fed, mixed.rows if mixed else None)
                        except Exception:
                            if mixed is None or runner.state is not None:
                                raise   # rows of per-row state may be half updated in place: none can step again
                            # the group's state is as it was: its rows step again alone; each new row runs on its
                            # own after it, so that only a row whose input breaks a step fails
                            self.stats.failed_steps += 1
                            log.exception("mixed step failed", device=self.name, component=group.component,
                                          rows=n, new_rows=len(mixed.items))
                            broke = Batch(group.component, mixed.items[0].mode, mixed.items), mixed.inputs
                            mixed = None
                            launch = runner.run_group(group, sl, fed)
                        device = runner.device_s
                        launched = group.launched(sl, launch.tokens, launch.logprobs, launch.extras)
                        if mixed is not None:
                            mixed.launch = launch
            except Exception as e:
                self.stats.failed_steps += 1
                log.exception("step failed", device=self.name, component=group.component, mode=group.mode, rows=n)
                for rid in dict.fromkeys(group.request_ids[sl] + (mixed.request_ids if mixed else [])):
                    self.walker.abort(rid, "error", f"{type(e).__name__}: {e}")
                mixed = None
            else:
                self.stats.steps += steps
                self.stats.rows += n * steps
                if mixed is not None:
                    self.stats.mixed_steps += 1
                    self.stats.mixed_graph_steps += runner.mixed_replayed
                    self.stats.mixed_rows += len(mixed.items)
        group.drop_held()  # a launch of several steps that failed after reading the one before: after the aborts
        if broke is not None:
            self._retry_alone(*broke)
        t1, c1 = time.perf_counter(), time.thread_time()
        if early:
            waited, read_s = early
            t0 += read_s  # that read is the finalize phase's, not the launch's
        else:
            with ranged("mstar.finalize"):
                waited = self.router.read_group(self.report, group, prev) if prev is not None else 0.0
            read_s = 0.0
        blocked = waited + (device if self.device.type == "cuda" else 0.0)
        self.stats.wait_s += blocked
        self.stats.launch_s += t1 - t0 - (device if self.device.type == "cuda" else 0.0)
        self.stats.finalize_s += time.perf_counter() - t1 + read_s - waited
        self.stats.launch_cpu_s += c1 - c0
        self.stats.finalize_cpu_s += time.thread_time() - c1
        if launched is not None:
            self._inflight[group] = launched
        else:
            self._inflight.pop(group, None)
        if mixed is not None:  # after the previous step's host work: reading these waits for this step
            t2 = time.perf_counter()
            # they were sampled on the group's stream; the worker's reads them (and routes them) from here on
            group.stream.worker_waits()
            outputs = mixed.outputs(group.stream.handed_out)
            self._chunked(mixed.items, mixed.inputs)
            for out in outputs:
                self.router.route(self.report, out, sampled=True)
            self.stats.mixed_s += time.perf_counter() - t2
        now = time.perf_counter()
        r = self.report
        r.component, r.mode, r.rows = group.component, group.mode, n
        r.steps = steps if launched is not None else 1
        r.step_s = now - self._group_mark.get(group, t0)
        r.device_s = waited + device
        self._group_mark[group] = now

    def _launch_steps(self, group: LoopGroup, sl: slice, runner: ComponentRunner, steps: int,
                      prev: Pending | None, early: list[float]) -> tuple[Pending, float]:
        """Launch `steps` decode steps of rows `sl` back to back, each row's
        token fed to its next step on the device; their `Pending`, and the
        seconds the runner spent on the device (CPU) or waiting for its
        inputs. The launch before (`prev`) is read once the first step is
        queued, while the device still runs it (each later step waits until
        the copies of the step before it have run, so that it may rewrite their
        page-locked staging): its tokens reach their streams
        a launch sooner. Its rows that stop stay in the tensors, stepping for
        nothing, until this launch is launched; `early` gets that read's
        wait and wall time. New requests arriving end the launch at the step
        it has queued (its `Pending.steps`), so that they wait for no more of
        it than for one step a launch, unless the component runs all the rows
        it may (they would wait anyway)."""
        drawn, device = [], 0.0
        for k in range(steps):
            if k == 1 and prev is not None:
                group.hold_drops()
                t0 = time.perf_counter()
                with ranged("mstar.finalize"):
                    waited = self.router.read_group(self.report, group, prev)
                early[:] = [waited, time.perf_counter() - t0]
            with ranged(f"mstar.{group.component}.{group.mode}"), group.stream.on():
                if not k:
                    group.stream.after_worker()
                launch = runner.run_group(group, sl)
                device += runner.device_s
                drawn.append(launch.tokens)
                if k == steps - 1 or (self.arriving() and not self.scheduler.at_cap(group.component)):
                    break
                group.advance(sl, launch.tokens)
        with group.stream.on():
            if len(drawn) == 1:
                return group.launched(sl, drawn[0]), device
            return group.launched(sl, torch.stack(drawn), steps=len(drawn)), device

    def _take_mixed(self, plan: StepPlan, runner: ComponentRunner) -> MixedItems | None:
        """The new rows riding in a group step, admitted, with their inputs;
        rows whose inputs cannot be taken fail alone (None: no new row)."""
        if not plan.items:
            return None
        if runner.state is not None:
            # a slot a row left may be handed out while a step with that row is still queued on the group's
            # stream: zeroing it (or swapping a row into it) on the worker's stream must come after that step
            plan.group.stream.worker_waits()
        try:
            return MixedItems.take(self._admit(plan.items, runner), runner)
        except Exception as e:
            log.exception("new rows of a mixed step failed", device=self.name, component=plan.component)
            self._fail(Batch(plan.component, plan.items[0].mode, plan.items), f"{type(e).__name__}: {e}")
            return None

    def _fed_window(self, group: LoopGroup, sl: slice) -> slice:
        """Window `sl` less its rows whose stream has no item for the step
        yet: they leave the group with their state exact, once every launched
        step is read (reading may feed them, or finish them), and park until
        one comes. Rare: a row joins with its item there, and the loop that
        feeds it steps as often as the group."""
        ready = self.walker.streams.ready
        if all(ready(part) for part in group.rows[sl]):
            return sl
        window = {id(part) for part in group.rows[sl]}
        self.settle()  # rows that stop leave now; the window's others stay in order
        for i in reversed([i for i, part in enumerate(group.rows) if id(part) in window and not ready(part)]):
            self.walker.awaits_stream(group.evict(i, "await"))
        kept = [i for i, part in enumerate(group.rows) if id(part) in window]
        return slice(kept[0], kept[-1] + 1) if kept else slice(0, 0)

    def settle(self) -> None:
        """Read every launched group step (before a step that changes pages
        or groups, or when there is nothing left to launch)."""
        while self._inflight:
            self._read(next(iter(self._inflight)))

    def _read(self, group: LoopGroup) -> None:
        """Read `group`'s launched step: it is in flight no more."""
        self.router.read_group(self.report, group, self._inflight[group])
        del self._inflight[group]  # only now: `busy` stays true until the step is read
        self._group_mark.pop(group, None)

    # ------------------------------------------------------------- reports

    def finished(self, fin: Finished | Awaiting) -> None:
        """A partition's end (or a request's wait for input), behind its emits."""
        self.outbox.finished(self.report, fin)

    def idle(self) -> None:
        """Nothing to launch: read what is in flight and wait for its copies,
        then report."""
        self.settle()
        self.outbox.release(self.report, wait=True)
        self.flush()

    def flush(self) -> None:
        self.outbox.release(self.report)
        # every step is reported, emits or not: metrics time the steps that only feed a stream too
        if not self.report.empty() or self.report.component:
            self.post(self.report)
        self.report = StepReport(device=self.name)
        self.link.flush()

    def clear(self) -> None:
        """Forget the launched steps (the worker is shutting down)."""
        self._inflight.clear()
        self._group_mark.clear()
