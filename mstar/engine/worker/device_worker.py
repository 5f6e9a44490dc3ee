"""A device worker: the one thread that runs the components placed on its
device.

Its loop: drain the inbox (the submits, stops and aborts that have come by
then) → ask the scheduler for
the next step's plan → carry it out (`Executor`: prepare inputs, forward,
sample, then stop rules, loop-back, streams, emits) → hand the event loop
one `StepReport` for the whole step → next plan. It never waits for the
event loop: a loop's next step is queued as soon as its previous step is
done (speculation), and a stop that the event loop sends later cancels what
is still queued; outputs of a step that already ran are dropped by the
engine.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Callable

import structlog
import torch

from mstar.config import EngineConfig
from mstar.engine.execution.components import build_runners
from mstar.engine.execution.runner import ComponentRunner
from mstar.engine.messages import (Abort, Append, Awaiting, CloseInput, Finished, Forward, Profile, Shutdown, Stop,
                                   StepReport, Submit, Unstarted)
from mstar.engine.movement.arena import HostArena
from mstar.engine.movement.tensor_store import TensorStore
from mstar.engine.worker.executor import Executor, WorkerStats
from mstar.engine.worker.streaming.peer_link import PeerLink
from mstar.engine.worker.preemption import Preemption
from mstar.engine.worker.profiling import WorkerProfiler
from mstar.engine.worker.walker import FORK_MODE, Walker
from mstar.models.base import Model
from mstar.scheduler import LaunchSteps, ModeCaps, PagePool, Scheduler
from mstar.scheduler.burst_gate import BurstGate

log = structlog.get_logger("mstar.worker")

_IDLE_WAIT_S = 0.05  # how long to wait for the inbox while queued work cannot be scheduled
DEFAULT_ARENA_MB = 64  # a CUDA worker's page-locked staging for emitted rows (PCM of a whole batch is ~2 MiB)
_COPY_POLL_S = 0.001  # how long to wait for the inbox while copies from other devices are in flight


class DeviceWorker:
    def __init__(self, device: str, model: Model, config: EngineConfig, store: TensorStore,
                 post: Callable[[StepReport], None], components: dict[str, tuple[str, ...]] | None = None,
                 index: int = 0, steps: LaunchSteps | None = None) -> None:
        """`components`: what runs here, component -> modes (default: the
        whole model); `index`: this worker's place among the engine's;
        `steps`: most decode steps a group's launch runs (the engine's reading
        of `--num-scheduler-steps` against the served walks; default: the
        flag's alone)."""
        self.device = torch.device(device)
        self.name = device
        self.index = index
        self.placed = components if components is not None else {c: s.modes for c, s in model.components.items()}
        self.link = PeerLink(self.device, store)  # to and from the other workers (`peers` set by the engine)
        self.model = model
        self.config = config
        self.steps = steps or LaunchSteps.of(config.scheduler.num_scheduler_steps)
        self.store = store
        self.post = post
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # new requests sent (by the event loop alone) and applied (by this thread alone): one writer each, so
        # the worker can tell that requests wait in its inbox among other workers' stream messages
        self.submits_sent = 0
        self.submits_applied = 0
        self.stats = WorkerStats()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.alive = False
        self.pools: dict[str, PagePool] = {}
        self.runners: dict[str, ComponentRunner] = {}
        self.profiler = WorkerProfiler(self.device)
        self.preemption: Preemption | None = None  # where rows take pages as they go: swaps rows out and in
        self._thread = threading.Thread(target=self._main, name=f"mstar-worker-{device}", daemon=True)

    # ------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def send(self, msg: object) -> None:
        self.inbox.put(msg)
        if isinstance(msg, Submit):  # after the put: a count ahead of the inbox would have the worker poll it
            self.submits_sent += 1

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def cpu_s(self) -> float:
        """The worker thread's CPU time so far, in seconds (0.0 before it starts)."""
        ident = self._thread.ident
        return 0.0 if ident is None else time.clock_gettime(time.pthread_getcpuclockid(ident))

    @property
    def components(self) -> list[str]:
        return list(self.placed)

    @property
    def busy(self) -> bool:
        """Work queued, or launched and not read yet (racy: for tests and stats)."""
        return self.scheduler.has_work() or self.executor.in_flight

    def pages_in_use(self) -> dict[str, int]:
        return {name: pool.num_used for name, pool in self.pools.items()}

    def state_slots(self) -> dict[str, dict[str, int]]:
        """Per component with per-row state: its slots held by rows, of how many."""
        if not hasattr(self, "scheduler"):  # its setup failed
            return {}
        return {name: {"in_use": pool.num_used, "total": pool.num_pages} for name, pool in self.scheduler.slots.items()}

    def prefix_caches(self) -> dict[str, dict[str, int]]:
        """Per KV component with a prefix cache: pages holding a cached prefix
        (`pages`; `unheld`: of those, held by no row), and prompt tokens looked
        up and found since start."""
        if not hasattr(self, "scheduler"):  # its setup failed
            return {}
        return {name: {"pages": len(cache), "unheld": cache.pool.num_cached, "queries": cache.stats.queries,
                       "hits": cache.stats.hits} for name, cache in self.scheduler.caches.items()}

    # -------------------------------------------------------------- setup

    def _mixing(self) -> dict[str, frozenset[str]]:
        """Per sampling KV component here, its name-only modes whose rows may
        share a step (`Component.apart`)."""
        out = {}
        for name, modes in self.placed.items():
            comp = self.model.components[name]
            if comp.kv_cache and comp.samples:
                out[name] = frozenset(m for m in modes if m not in comp.signatures and m not in comp.apart)
        return out

    def _setup(self) -> None:
        cfg = self.config.scheduler
        caps = {}
        built = build_runners(self.model, tuple(self.placed), self.device, self.store, self.config)
        for name, modes in self.placed.items():
            runner, pool = built[name]
            self.runners[name] = runner
            if pool is not None:
                self.pools[name] = pool
                caps[(name, FORK_MODE)] = ModeCaps(cfg.max_num_seqs, cfg.max_num_batched_tokens)
            for mode in modes:
                caps[(name, mode)] = ModeCaps(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        grows = cfg.kv_reservation != "request"  # some rows take their pages as they go, and may be preempted
        # a request that starts decoding beyond max_num_seqs running rows waits its turn
        # a component with per-row state: a row takes a slot with its first pages (slots are pages of one)
        slots = {name: PagePool(r.state.num_slots, 1) for name, r in self.runners.items() if r.state is not None}
        self.gate = BurstGate(cfg.admission_gather_ms / 1000)
        self.scheduler = Scheduler(caps, self.pools, max_running=dict.fromkeys(self.pools, cfg.max_num_seqs),
                                   grow_pages=grows, slots=slots, prefix_caching=cfg.prefix_caching,
                                   admit_every=cfg.admit_every, mix=self._mixing() if cfg.mixed_steps else {},
                                   mix_tokens={name: r.mixed_graphs.max_new_tokens for name, r in self.runners.items()
                                               if r.mixed_graphs is not None}, steps=self.steps)
        token_loops = {n for n in self.placed if self.model.components[n].kv_cache and self.model.components[n].samples}
        self.walker = Walker(self.store, self.scheduler, self.pools, self.model.max_model_len, self._finished,
                             token_loops, self.device, reservation=cfg.kv_reservation, join_turn=self.model.join_turn,
                             on_awaiting=lambda rid, n: self._finished(Awaiting(rid, n)),
                             index=self.index, send=self.link.send, components=self.model.components,
                             slots=slots, min_turn_tokens=self.model.min_turn_tokens)
        arena_mb = self.config.host_arena_mb
        if arena_mb is None:  # pinned staging pays on CUDA; on the CPU rows are host memory already
            arena_mb = DEFAULT_ARENA_MB if self.device.type == "cuda" else 0
        self.arena = HostArena(arena_mb << 20, pin=self.device.type == "cuda") if arena_mb else None
        caches = {name: r.kv for name, r in self.runners.items() if r.kv is not None}
        states = {name: r.state for name, r in self.runners.items() if r.state is not None}
        self.preemption = Preemption(caches, self.walker, states, slots) if grows else None
        self.executor = Executor(self.name, self.device, self.runners, self.walker, self.scheduler, self.store,
                                 self.link, self.post, self.arena, self.preemption, self.stats,
                                 lambda: self.submits_sent > self.submits_applied)

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
            self.profiler.close(f"the worker on {self.name} stopped")
            self._fail_all(f"the worker on {self.name} stopped: {self.error!r}" if self.error else None)
            self._release()

    def _release(self) -> None:
        """Drop the modules, KV caches and graphs, and give their device
        memory back (another engine may start in this process)."""
        self.link.close()
        if getattr(self, "arena", None) is not None:
            self.arena.close(force=True)  # blocks of reports nobody will read any more
        self.runners.clear()
        if self.preemption is not None:  # it holds the KV caches and state slots too
            self.preemption.clear()
        if getattr(self, "executor", None) is not None:
            self.executor.clear()
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
        ex = self.executor
        while True:
            idle = not self.scheduler.has_work() and not ex.in_flight and not ex.outbox
            if not self._drain(block=waiting or idle):
                return
            self.link.poll()
            arriving = self.submits_sent > self.submits_applied  # requests in the inbox: the burst goes on
            self.scheduler.held = self.gate.held(time.monotonic(), arriving=arriving)
            plan = ex.next_plan()
            if plan is None:  # nothing to launch: read what is in flight
                ex.idle()
                waiting = self.scheduler.has_work()
                continue
            waiting = False
            ex.run(plan)
            ex.flush()

    def _drain(self, block: bool) -> bool:
        """Apply the messages in the inbox when the drain begins (waiting for
        one first when `block`); False on shutdown."""
        try:
            if block:
                self.profiler.check()
                timeout = _IDLE_WAIT_S if self.scheduler.has_work() or self.profiler.running else None
                if self.link.pending:  # a copy's source is released once the copy is done: look again soon
                    timeout = _COPY_POLL_S
                held = self.gate.wait_s(time.monotonic())  # new rows start when the burst pauses, if nothing comes
                if held is not None:
                    timeout = held if timeout is None else min(timeout, held)
                msg = self.inbox.get(timeout=timeout)
            else:
                self.profiler.check()
                msg = self.inbox.get_nowait()
        except queue.Empty:
            return True
        # only what had come by now: under a burst the event loop sends submits about as fast as they are
        # applied, and a drain that waited for the inbox to run dry would start none of them until the last
        # had come (the first request of 64 waited for the other 63's arrival); the rest are applied after
        # the next step is planned and launched
        more = self.inbox.qsize()
        while True:
            if isinstance(msg, Shutdown):
                return False
            self._apply(msg)
            if more <= 0:
                return True
            more -= 1
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, msg: object) -> None:
        if isinstance(msg, Submit):
            self.submits_applied += 1
            if msg.sent_at is not None and self.gate.arrived(msg.sent_at):
                self.scheduler.opened_burst()
            try:
                self.walker.start(msg)
            except Exception as e:  # a bad request must not take the worker down
                log.exception("submit failed", request_id=msg.request_id)
                self.walker.abort(msg.request_id, "error", f"{type(e).__name__}: {e}")
        elif isinstance(msg, Stop):
            self.stats.cancelled_steps += self.walker.stop(msg.request_id, msg.partition)
        elif isinstance(msg, Append):
            self.walker.turns.append(msg.request_id, msg.values, msg.num_tokens)
        elif isinstance(msg, CloseInput):
            self.walker.turns.close(msg.request_id)
        elif isinstance(msg, Abort):
            self.walker.abort(msg.request_id, msg.reason)
        elif isinstance(msg, Forward):
            self.link.receive(msg, self.walker.streams)
        elif isinstance(msg, Profile):
            self.profiler.start(msg)
        elif isinstance(msg, Unstarted):
            msg.done.set_result(self.walker.unstarted(msg.request_ids))
        else:
            raise TypeError(f"unknown worker message {msg!r}")

    def _finished(self, fin: Finished | Awaiting) -> None:
        self.executor.finished(fin)
