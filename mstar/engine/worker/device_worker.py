"""A device worker: the one thread that runs the components placed on its
device.

Its loop: drain the inbox (submits, stops, aborts) → let the scheduler build a
batch → run it (prepare inputs, forward, sample) → fast postprocess (stop
rules, loop-back, streams, emits) → hand the event loop one `StepReport` for
the whole step → next batch. It never waits for the event loop: a loop's next
step is queued as soon as its previous step is done (speculation), and a stop
that the event loop sends later cancels what is still queued; outputs of a
step that already ran are dropped by the engine.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import structlog
import torch

from mstar.config import EngineConfig
from mstar.engine.execution.components import build_runner
from mstar.engine.worker.loop_group import LoopGroup, Pending
from mstar.engine.messages import (Abort, Append, Awaiting, CloseInput, EmitBatch, Finished, Forward, Profile,
                                   Shutdown, Stop, StepReport, Submit)
from mstar.engine.movement.arena import HostArena, stage_to_host
from mstar.engine.worker.outbox import Outbox
from mstar.engine.worker.peer_link import PeerLink
from mstar.engine.worker.preemption import Preemption
from mstar.engine.worker.profiling import WorkerProfiler
from mstar.engine.execution.runner import ComponentRunner, StepOutput
from mstar.engine.worker.stop_rules import stop_reasons
from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.movement.transfer import select_rows
from mstar.engine.worker.walker import Walker
from mstar.models.base import Model
from mstar.scheduler import Batch, ModeCaps, PagePool, Scheduler

log = structlog.get_logger("mstar.worker")

_IDLE_WAIT_S = 0.05  # how long to wait for the inbox while queued work cannot be scheduled
DEFAULT_ARENA_MB = 64  # a CUDA worker's page-locked staging for emitted rows (PCM of a whole batch is ~2 MiB)
_COPY_POLL_S = 0.001  # how long to wait for the inbox while copies from other devices are in flight


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
    failed_steps: int = 0


class DeviceWorker:
    def __init__(self, device: str, model: Model, config: EngineConfig, store: TensorStore,
                 post: Callable[[StepReport], None], components: dict[str, tuple[str, ...]] | None = None,
                 index: int = 0) -> None:
        """`components`: what runs here, component -> modes (default: the
        whole model); `index`: this worker's place among the engine's."""
        self.device = torch.device(device)
        self.name = device
        self.index = index
        self.placed = components if components is not None else {c: s.modes for c, s in model.components.items()}
        self.link = PeerLink(self.device, store)  # to and from the other workers (`peers` set by the engine)
        self.model = model
        self.config = config
        self.store = store
        self.post = post
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = WorkerStats()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.alive = False
        self.pools: dict[str, PagePool] = {}
        self.runners: dict[str, ComponentRunner] = {}
        self._report = StepReport(device=device)
        self.outbox = Outbox()
        self.profiler = WorkerProfiler(self.device)
        self._inflight: dict[LoopGroup, Pending] = {}  # launched group steps not read yet
        self._group_mark: dict[LoopGroup, float] = {}   # when each group's last step was done
        self._thread = threading.Thread(target=self._main, name=f"mstar-worker-{device}", daemon=True)

    # ------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def send(self, msg: object) -> None:
        self.inbox.put(msg)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def components(self) -> list[str]:
        return list(self.placed)

    @property
    def busy(self) -> bool:
        """Work queued, or launched and not read yet (racy: for tests and stats)."""
        return self.scheduler.has_work() or bool(self._inflight)

    def pages_in_use(self) -> dict[str, int]:
        return {name: pool.num_used for name, pool in self.pools.items()}

    # -------------------------------------------------------------- setup

    def _setup(self) -> None:
        cfg = self.config.scheduler
        caps = {}
        for name, modes in self.placed.items():
            spec = self.model.components[name]
            runner, pool = build_runner(self.model, name, spec, self.device, self.store, self.config)
            self.runners[name] = runner
            if pool is not None:
                self.pools[name] = pool
            for mode in modes:
                caps[(name, mode)] = ModeCaps(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        # a request that starts decoding beyond max_num_seqs running rows waits its turn
        self.scheduler = Scheduler(caps, self.pools, max_running=dict.fromkeys(self.pools, cfg.max_num_seqs))
        token_loops = {n for n in self.placed if self.model.components[n].kv_cache and self.model.components[n].samples}
        lazy = cfg.kv_reservation == "lazy"
        self.walker = Walker(self.store, self.scheduler, self.pools, self.model.max_model_len, self._finished,
                             token_loops, self.device, lazy_pages=lazy, join_turn=self.model.join_turn,
                             on_awaiting=lambda rid, n: self.outbox.finished(self._report, Awaiting(rid, n)),
                             index=self.index, send=self.link.send, components=self.model.components)
        arena_mb = self.config.host_arena_mb
        if arena_mb is None:  # pinned staging pays on CUDA; on the CPU rows are host memory already
            arena_mb = DEFAULT_ARENA_MB if self.device.type == "cuda" else 0
        self.arena = HostArena(arena_mb << 20, pin=self.device.type == "cuda") if arena_mb else None
        caches = {name: r.kv for name, r in self.runners.items() if r.kv is not None}
        self.preemption = Preemption(self.pools, caches, self.walker, self._settle) if lazy else None

    # --------------------------------------------------------------- loop

    def _main(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                self._setup()
        except BaseException as e:  # reported to the engine, which fails its start
            self.error = e
            self.ready.set()
            return
        self.alive = True
        self.ready.set()
        try:
            with torch.inference_mode():
                self._loop()
        except BaseException as e:
            self.error = e
            log.error("worker died", device=self.name, error=repr(e), trace=traceback.format_exc())
        finally:
            self.alive = False
            self._fail_all(f"the worker on {self.name} stopped: {self.error!r}" if self.error else None)
            self._release()

    def _release(self) -> None:
        """Drop the modules, KV caches and graphs, and give their device
        memory back (another engine may start in this process)."""
        self.link.close()
        if getattr(self, "arena", None) is not None:
            self.arena.close(force=True)  # blocks of reports nobody will read any more
        self.runners.clear()
        self._inflight.clear()
        self._group_mark.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _fail_all(self, error: str | None) -> None:
        """Tell the event loop that every request still here is over; the
        worker's own state may be broken, so nothing is freed through it."""
        walker = getattr(self, "walker", None)
        runs = list(walker.runs) if walker is not None else []
        reason = "error" if error else "abort"
        report = StepReport(device=self.name, finished=[Finished(rid, "", reason, True, error) for rid in runs])
        if runs:
            self.post(report)

    def _loop(self) -> None:
        waiting = False
        while True:
            idle = not self.scheduler.has_work() and not self._inflight and not self.outbox
            if not self._drain(block=waiting or idle):
                return
            self.link.poll()
            batch = self.scheduler.schedule()
            if batch is None:  # nothing to launch: read what is in flight
                self._settle()
                self.outbox.release(self._report, wait=True)
                self._flush()
                waiting = self.scheduler.has_work()
                continue
            waiting = False
            if batch.group is not None:
                self._launch_group(batch.group)
            else:
                # a KV step changes pages and groups that launched steps read; a
                # plain step only queues behind them on the device
                if batch.component in self.pools:
                    self._settle()
                self._step(batch)
            self._flush()

    def _drain(self, block: bool) -> bool:
        """Apply every message in the inbox; False on shutdown."""
        try:
            if block:
                self.profiler.check()
                timeout = _IDLE_WAIT_S if self.scheduler.has_work() or self.profiler.running else None
                if self.link.pending:  # a copy's source is released once the copy is done: look again soon
                    timeout = _COPY_POLL_S
                msg = self.inbox.get(timeout=timeout)
            else:
                self.profiler.check()
                msg = self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, Shutdown):
                return False
            self._apply(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, msg: object) -> None:
        if isinstance(msg, Submit):
            try:
                self.walker.start(msg)
            except Exception as e:  # a bad request must not take the worker down
                log.exception("submit failed", request_id=msg.request_id)
                self.walker.abort(msg.request_id, "error", f"{type(e).__name__}: {e}")
        elif isinstance(msg, Stop):
            self.stats.cancelled_steps += self.walker.stop(msg.request_id, msg.partition)
        elif isinstance(msg, Append):
            self.walker.turns.append(msg.request_id, msg.values)
        elif isinstance(msg, CloseInput):
            self.walker.turns.close(msg.request_id)
        elif isinstance(msg, Abort):
            self.walker.abort(msg.request_id, msg.reason)
        elif isinstance(msg, Forward):
            self.link.receive(msg, self.walker.streams)
        elif isinstance(msg, Profile):
            self.profiler.start(msg)
        else:
            raise TypeError(f"unknown worker message {msg!r}")

    # --------------------------------------------------------------- step

    def _step(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        for item in batch.items:
            if item.pages:  # pages the scheduler admitted the row with: the row owns them now
                part = item.payload[0]
                part.pages.extend(item.pages)
                part.kv_component = item.component
                item.pages = []
        if self.preemption is not None:
            batch.items = self.preemption.resume(batch.items)
            if not batch.items:
                return
        runner = self.runners[batch.component]
        inputs: list[dict[str, torch.Tensor]] | None = None
        try:
            inputs = runner.take_inputs(batch)
            with torch.profiler.record_function(f"mstar.{batch.component}.{batch.mode}"):
                out = runner.compute(batch, inputs)
        except Exception as e:
            self.stats.failed_steps += 1
            log.exception("step failed", device=self.name, component=batch.component, mode=batch.mode,
                          rows=len(batch))
            if inputs is None or len(batch) == 1:
                self._fail(batch, f"{type(e).__name__}: {e}")
            else:
                self._retry_alone(batch, inputs)
            return
        with torch.profiler.record_function("mstar.route"):
            # a sampling step has waited for its tokens already: reading them costs no wait
            self._route(out, sampled=runner.spec.samples)
        self.stats.steps += 1
        self.stats.rows += len(batch)
        r = self._report
        r.component, r.mode, r.rows = batch.component, batch.mode, len(batch)
        r.step_s = time.perf_counter() - t0
        r.device_s = self.runners[batch.component].device_s

    def _launch_group(self, group: LoopGroup) -> None:
        """Launch the next decode step of a token loop group, then read the
        previous one's tokens while the device computes: the host work of a
        step (stop rules, emits, routing, the report) overlaps the next step,
        and on CUDA the next step is prepared while the previous one runs.
        No per-row work but for rows that stop (and rows feeding a stream)."""
        runner = self.runners[group.component]
        if self.preemption is not None:
            self.preemption.grow(group)  # may read the launched steps first
        prev = self._inflight.get(group)
        t0 = time.perf_counter()
        try:
            sl = group.window(self.config.scheduler.max_num_seqs)
        except Exception as e:  # the rows joining now failed to join (their prefill built the same tensors)
            log.exception("rows could not join their decode group", device=self.name, component=group.component)
            for rid in dict.fromkeys(group.joining()):
                self.walker.abort(rid, "error", f"{type(e).__name__}: {e}")
            sl = group.window(self.config.scheduler.max_num_seqs)
        n = sl.stop - sl.start
        launched: Pending | None = None
        if n:
            try:
                with torch.profiler.record_function(f"mstar.{group.component}.{group.mode}"):
                    tokens, logprobs = runner.run_group(group, sl)
            except Exception as e:
                self.stats.failed_steps += 1
                log.exception("step failed", device=self.name, component=group.component, mode=group.mode, rows=n)
                for rid in dict.fromkeys(group.request_ids[sl]):
                    self.walker.abort(rid, "error", f"{type(e).__name__}: {e}")
            else:
                launched = group.launched(sl, tokens, logprobs)
                self.stats.steps += 1
                self.stats.rows += n
        t1 = time.perf_counter()
        # on CUDA the runner only waited for the previous step's inputs to land;
        # on the CPU it computed (synchronously) for that long
        device = runner.device_s if n else 0.0
        with torch.profiler.record_function("mstar.finalize"):
            waited = self._finalize_group(group, prev) if prev is not None else 0.0
        blocked = waited + (device if self.device.type == "cuda" else 0.0)
        self.stats.wait_s += blocked
        self.stats.launch_s += t1 - t0 - (device if self.device.type == "cuda" else 0.0)
        self.stats.finalize_s += time.perf_counter() - t1 - waited
        if launched is not None:
            self._inflight[group] = launched
        else:
            self._inflight.pop(group, None)
        now = time.perf_counter()
        r = self._report
        r.component, r.mode, r.rows = group.component, group.mode, n
        r.step_s = now - self._group_mark.get(group, t0)
        r.device_s = waited + device
        self._group_mark[group] = now

    def _finalize_group(self, group: LoopGroup, p: Pending) -> float:
        """Route what step `p` sampled; returns the time spent waiting for it."""
        t0 = time.perf_counter()
        p.wait()
        waited = time.perf_counter() - t0
        host = p.host.clone()  # its pinned buffer is reused two launches on; the event loop reads later
        leaving = group.finalize(p)
        valid = group.valid_rows(p)
        value = group.loop.value
        walk = p.rows[0].request.walk
        keep = range(len(p.rows)) if valid is None else valid
        self.stats.dropped_rows += len(p.rows) - len(keep)
        if value in walk.emits:
            if valid is None:
                self.outbox.emit(self._report, EmitBatch(value, p.request_ids, p.partitions, host,
                                                         logprobs=p.logprobs))
            elif valid:
                self.outbox.emit(self._report, EmitBatch(value, [p.request_ids[i] for i in valid],
                                                         [p.partitions[i] for i in valid], host[valid],
                                                         logprobs=None if p.logprobs is None else p.logprobs[valid]))
        if walk.streams.get(value):
            gone = {id(leave.part) for leave in leaving}
            keep = set(keep)
            items = host.tolist()  # token ids enter streams as host ints
            for i in keep:
                if id(p.rows[i]) not in gone and not p.rows[i].done:
                    self.walker.streams.feed(p.rows[i], value, items[i])
        for leave in leaving:
            self.walker.left_group(leave)
        return waited

    def _settle(self) -> None:
        """Read every launched group step (before a step of another kind, or
        when there is nothing left to launch)."""
        while self._inflight:
            group = next(iter(self._inflight))
            self._finalize_group(group, self._inflight[group])
            del self._inflight[group]  # only now: `busy` stays true until the step is read
            self._group_mark.pop(group, None)

    def _fail(self, batch: Batch, error: str) -> None:
        for item in batch.items:
            item.payload[0].busy = False
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
                self._route(out, sampled=runner.spec.samples)

    def _route(self, out: StepOutput, sampled: bool = False) -> None:
        """Fast postprocess of a step: emits, stop rules, then every row moves
        on. `sampled`: the step's outputs are token ids [B] it sampled."""
        parts = out.parts
        reasons = stop_reasons(parts, {k: v for k, v in out.values.items()
                                                   if isinstance(v, torch.Tensor)})
        rids = [p.request_id for p in parts]
        refs: dict[str, list[TensorRef]] = {}
        for name, data in out.values.items():
            emitting = [i for i, p in enumerate(parts) if name in p.request.walk.emits]
            if emitting:
                rows = [data[i] for i in emitting] if isinstance(data, list) else select_rows(data.detach(), emitting)
                # no wait: the rows reach the report once copied (into the arena, freed once the engine read them)
                host, ready, blocks = stage_to_host(rows, self.arena, stage_cpu=True)
                self.outbox.emit(self._report, EmitBatch(
                    name, [rids[i] for i in emitting], [parts[i].name for i in emitting], host, blocks,
                    None if out.logprobs is None else out.logprobs[emitting]), ready)
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
        for i, part in enumerate(parts):
            self.walker.completed(part, {name: rs[i] for name, rs in refs.items()}, reasons[i],
                                  {name: ids[i] for name, ids in tokens.items()})

    def _finished(self, fin: Finished) -> None:
        self.outbox.finished(self._report, fin)

    def _flush(self) -> None:
        self.outbox.release(self._report)
        # every step is reported, emits or not: metrics time the steps that only feed a stream too
        if not self._report.empty() or self._report.component:
            self.post(self._report)
        self._report = StepReport(device=self.name)
        self.link.flush()
