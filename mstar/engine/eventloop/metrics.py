"""The engine's Prometheus metrics: what the event loop sees (requests,
first outputs, step reports) is recorded as it happens; what the workers own
(queues, KV pages, speculation counters) is read from them at scrape time.

Everything here runs on the event loop, so nothing is locked. The worker-side
numbers are read across threads without a lock: each is one int that only its
worker writes, so a scrape may be a step stale but never torn.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mstar.engine.eventloop.prometheus import BATCH_BUCKETS, LATENCY_BUCKETS, Histogram, Labels, family

LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
GC_GENERATIONS = ("0", "1", "2")

if TYPE_CHECKING:
    from mstar.engine.messages import StepReport
    from mstar.engine.worker.device_worker import DeviceWorker

STATUSES = ("stop", "length", "abort", "error", "timeout")


class LagMonitor:
    """Samples the event loop's lag: a callback scheduled `interval` ahead
    runs late by however long the loop was busy with other work (reports,
    HTTP, detokenising). Runs until `stop`."""

    def __init__(self, hist: Histogram, interval: float = 0.01) -> None:
        self.hist = hist
        self.interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._arm(loop, loop.time())

    def _arm(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        due = now + self.interval
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        self.hist.observe(max(0.0, now - due))
        self._arm(loop, now)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class GCPauses:
    """Times Python's garbage collections by generation (`gc.callbacks`).
    A collection holds the GIL, so every worker and the event loop wait it
    out: a full one over a process's startup objects took ~0.2 s on the CPU
    box. The callback runs on whichever thread allocated when the collector
    ran; its series exist from the start, so a scrape never sees the dict
    change size. A collection already under way when the hook went in (its
    "stop" without a "start") is not timed."""

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist
        for generation in GC_GENERATIONS:
            hist.add_series((("generation", generation),))
        self._t0: float | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        t0, self._t0 = self._t0, None
        generation = str(info.get("generation"))
        if t0 is not None and generation in GC_GENERATIONS:
            self.hist.observe(time.perf_counter() - t0, (("generation", generation),))

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


class EngineMetrics:
    def __init__(self) -> None:
        self.requests: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.ttfa = Histogram(LATENCY_BUCKETS)
        self.step_seconds = Histogram(LATENCY_BUCKETS, labelled=True)
        self.batch_size = Histogram(BATCH_BUCKETS, labelled=True)
        self.decode_steps = 0
        self.loop_lag = Histogram(LAG_BUCKETS)  # event-loop lateness, sampled by `LagMonitor`
        self.gc_pauses = Histogram(LAG_BUCKETS, labelled=True)  # by generation, timed by `GCPauses`
        # submit times of requests still waiting for their first token / audio;
        # an entry leaves at the first output or when the request ends, so the
        # per-row check in `outputs` is one dict pop on a small dict
        self._await_text: dict[str, float] = {}
        self._await_audio: dict[str, float] = {}
        # answers that ran to their end: submit to end, and per output token after the first
        self.e2e = Histogram(E2E_BUCKETS)
        self.per_token = Histogram(TOKEN_GAP_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.refused = 0  # requests turned away: the waiting line full (429), or a drain before they began (503)
        self._submitted_at: dict[str, float] = {}
        self._first_at: dict[str, float] = {}  # when a request's first output of any kind came
        # an answer's time, split (vLLM's request_queue/prefill/decode_time_seconds): submit to its first step's
        # start (waiting), that start to its first drawn token (computing), and that token to its end. Workers
        # report the start of the step that ran the request's first work item (`WorkItem.first_step`: its first
        # prompt chunk, or the media encoder's step before it). All three are observed as the answer ends, as
        # vLLM records a finished request's: the same answers in each, which add up to their end-to-end time
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.prefill_time = Histogram(LATENCY_BUCKETS)
        self.decode_time = Histogram(E2E_BUCKETS)
        # as `_await_text`: requests until their first step started, then until their first token is drawn;
        # small, and empty in the steady state, where the per-row checks are one `if not dict`
        self._await_start: dict[str, float] = {}
        self._await_draw: dict[str, float] = {}
        self._started_at: dict[str, float] = {}  # when a request's first step started, until it ends
        self._drawn_at: dict[str, float] = {}  # when a request's first token was drawn, until it ends

    # ----------------------------------------------------------- recording

    def submitted(self, request_id: str) -> None:
        now = time.perf_counter()
        self._await_text[request_id] = now
        self._await_audio[request_id] = now
        self._submitted_at[request_id] = now
        self._await_start[request_id] = now

    def started(self, starts: Sequence[tuple[str, float]]) -> None:
        """Worker steps computed the first work of these requests, each step
        beginning at its `time.perf_counter()` (`StepReport.started`). The
        first such step counts: a later one of the same request (another
        component's first) finds it gone from the dict."""
        waiting = self._await_start
        if not waiting:
            return
        for rid, at in starts:
            if waiting.pop(rid, None) is not None:
                self._started_at[rid] = self._await_draw[rid] = at

    def drawn(self, request_ids: Sequence[str]) -> None:
        """A report read now brings tokens these requests drew (text tokens
        emitted, or audio codes only counted: `StepReport.sampled`): a
        request's first ends its prefill time."""
        waiting = self._await_draw
        if not waiting:  # the steady state: every running request has drawn its first token
            return
        now = time.perf_counter()
        for rid in request_ids:
            if waiting.pop(rid, None) is not None:
                self._drawn_at[rid] = now

    def outputs(self, request_ids: Sequence[str], modality: str) -> None:
        """Chunks were produced for these requests (one emit batch)."""
        if modality != "audio":
            # a step's own output (text tokens; a toy walk's data): before the first token's time below, so that
            # queue + prefill never exceed it. Audio comes from a codec, after the codes `sampled` brought
            self.drawn(request_ids)
        if modality == "text":
            waiting, hist = self._await_text, self.ttft
        elif modality == "audio":
            waiting, hist = self._await_audio, self.ttfa
        else:
            return
        if not waiting:  # the steady state: every running request has had its first output
            return
        now = time.perf_counter()
        for rid in request_ids:
            t0 = waiting.pop(rid, None)
            if t0 is not None:
                hist.observe(now - t0)
                self._first_at.setdefault(rid, now)  # the first output of any kind

    def forget(self, request_id: str) -> None:
        """The request produces no more chunks (aborted, timed out): nothing
        of it is timed, and it leaves every per-request dict now (its
        workers' confirmation may never come)."""
        for times in (self._await_text, self._await_audio, self._await_start, self._await_draw, self._started_at,
                      self._drawn_at, self._submitted_at, self._first_at):
            times.pop(request_id, None)

    def generated(self, tokens: int) -> None:
        """Running requests drew `tokens` more (text tokens the event loop
        took in, audio codes the workers reported): counted now, so that a
        scrape during a long answer sees it grow (vLLM's
        generation_tokens_total moves as tokens are drawn)."""
        self.generation_tokens += tokens

    def finished(self, request_id: str, status: str, prompt_tokens: int = 0, output_tokens: int = 0,
                 counted: int = 0) -> None:
        """The request is over (its workers confirmed it), `output_tokens`
        drawn after `prompt_tokens`, `counted` of them counted already as
        they came (`generated`): the rest count now. An answer that ran to
        its end ("stop", "length") is timed whole and per output token after
        its first, and split: waiting, computing to its first drawn token,
        and from there to its end."""
        t0, first = self._submitted_at.get(request_id), self._first_at.get(request_id)
        started, drawn = self._started_at.get(request_id), self._drawn_at.get(request_id)
        self.forget(request_id)
        self.requests[status if status in self.requests else "error"] += 1
        self.prompt_tokens += prompt_tokens
        # never less than counted: a counter does not go back (a worker that failed reports no count, and the
        # tokens it reported drawing stay counted)
        self.generation_tokens += max(0, output_tokens - counted)
        now = time.perf_counter()
        if status not in ("stop", "length"):
            return
        if t0 is not None:
            self.e2e.observe(now - t0)
            if started is not None:
                self.queue_time.observe(started - t0)
        if started is not None and drawn is not None:
            self.prefill_time.observe(drawn - started)
        if drawn is not None:
            self.decode_time.observe(now - drawn)
        if first is not None and output_tokens > 1:
            self.per_token.observe((now - first) / (output_tokens - 1))

    def on_report(self, report: StepReport) -> None:
        """A report hook: one step's component, mode, rows and duration."""
        if report.rows <= 0 or not report.component:
            return  # an inbox pass or an empty group launch: no step ran
        labels: Labels = (("component", report.component), ("mode", report.mode))
        for _ in range(report.steps):  # a launch of several steps: each counts, at its share of the time
            self.step_seconds.observe(report.step_s / report.steps, labels)
            self.batch_size.observe(report.rows, labels)
        if report.mode == "decode":
            self.decode_steps += report.steps

    # ----------------------------------------------------------- rendering

    def render(self, workers: Iterable[DeviceWorker], requests_running: int, tensors_held: int,
               outputs_dropped: int) -> str:
        workers = list(workers)
        # a worker that failed in setup has no scheduler
        waiting = sum(w.scheduler.num_to_start() for w in workers if hasattr(w, "scheduler"))
        pools = [((("device", w.name), ("component", c)), p) for w in workers for c, p in list(w.pools.items())]
        caches = [((("device", w.name), ("component", c)), stats) for w in workers
                  for c, stats in w.prefix_caches().items()]
        slots = [((("device", w.name), ("component", c)), n) for w in workers if hasattr(w, "state_slots")
                 for c, n in w.state_slots().items()]
        dropped = outputs_dropped + sum(w.stats.cancelled_steps + w.stats.dropped_rows for w in workers)
        preempted = sum(w.preemption.preempted for w in workers if getattr(w, "preemption", None) is not None)
        parts = [
            family("mstar_requests_total", "counter", "Requests finished, by final status.",
                   [((("status", s),), n) for s, n in self.requests.items()]),
            family("mstar_requests_running", "gauge", "Requests submitted and not finished.",
                   [((), requests_running)]),
            family("mstar_requests_refused_total", "counter",
                   "Requests turned away: with a 429, the waiting line stayed full (--max-waiting-requests) for "
                   "--queue-timeout; with a 503, the server began shutting down before they started.",
                   [((), self.refused)]),
            family("mstar_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [((), self.prompt_tokens)]),
            family("mstar_generation_tokens_total", "counter",
                   "Tokens requests drew (a spoken answer's audio codes included), counted as they are drawn: once "
                   "a request ends, its share is its usage's completion tokens.",
                   [((), self.generation_tokens)]),
            family("mstar_e2e_request_latency_seconds", "histogram",
                   "Seconds from submit to the end of answers that ran to it (stop, length).", self.e2e),
            family("mstar_time_per_output_token_seconds", "histogram",
                   "Per answer that ran to its end: seconds from its first output to its end over its output "
                   "tokens after the first.", self.per_token),
            family("mstar_queue_depth", "gauge", "Rows waiting to start in the workers' schedulers: new requests "
                   "not admitted yet (running rows are not).", [((), waiting)]),
            family("mstar_time_to_first_token_seconds", "histogram",
                   "Seconds from submit to the first chunk with tokens or text.", self.ttft),
            family("mstar_time_to_first_audio_seconds", "histogram",
                   "Seconds from submit to the first chunk with audio.", self.ttfa),
            family("mstar_request_queue_time_seconds", "histogram",
                   "Per answer that ran to its end (stop, length): seconds from submit to the start of the first "
                   "worker step that computed any of its work (its media's encoding, or its first prompt chunk in "
                   "a prompt step or a decode step it rode in): time waiting.",
                   self.queue_time),
            family("mstar_request_prefill_time_seconds", "histogram",
                   "Per answer that ran to its end (stop, length): seconds from the start of its first step to "
                   "its first drawn token (a text token, or a spoken answer's first audio code), as the event "
                   "loop reads it.", self.prefill_time),
            family("mstar_request_decode_time_seconds", "histogram",
                   "Per answer that ran to its end (stop, length): seconds from its first drawn token to its end.",
                   self.decode_time),
            family("mstar_step_seconds", "histogram", "Seconds per worker step.", self.step_seconds),
            family("mstar_batch_size", "histogram", "Rows per worker step.", self.batch_size),
            family("mstar_decode_steps_total", "counter", "Decode steps run.", [((), self.decode_steps)]),
            family("mstar_speculative_steps_dropped_total", "counter",
                   "Speculative work thrown away: cancelled queued steps, dead rows of launched steps, "
                   "outputs the engine dropped.", [((), dropped)]),
            family("mstar_kv_rows_running", "gauge",
                   "Rows holding KV pages, per device and component (capped at --max-num-seqs).",
                   [((("device", w.name), ("component", c)), n) for w in workers if hasattr(w, "scheduler")
                    for c, n in w.scheduler.running.items()]),
            family("mstar_preemptions_total", "counter",
                   "Running rows swapped out for lack of KV pages (--kv-reservation lazy).", [((), preempted)]),
            family("mstar_kv_pages_in_use", "gauge", "KV cache pages held by requests.",
                   [(labels, p.num_used) for labels, p in pools]),
            family("mstar_kv_pages_total", "gauge", "KV cache pages in the pool.",
                   [(labels, p.num_pages) for labels, p in pools]),
            family("mstar_state_slots_in_use", "gauge",
                   "Slots of per-row state (a recurrent layer's) held by rows, per device and component.",
                   [(labels, n["in_use"]) for labels, n in slots]),
            family("mstar_state_slots_total", "gauge", "Slots of per-row state in the pool (--state-slots).",
                   [(labels, n["total"]) for labels, n in slots]),
            family("mstar_prefix_cache_queries_total", "counter",
                   "Prompt tokens of new rows looked up in the prefix cache.",
                   [(labels, c["queries"]) for labels, c in caches]),
            family("mstar_prefix_cache_hits_total", "counter",
                   "Prompt tokens whose KV came from the prefix cache.", [(labels, c["hits"]) for labels, c in caches]),
            family("mstar_prefix_cache_pages", "gauge",
                   "KV pages holding a cached prefix, held by rows or kept for reuse.",
                   [(labels, c["pages"]) for labels, c in caches]),
            family("mstar_tensors_held", "gauge", "Tensors held in the engine's tensor store.",
                   [((), tensors_held)]),
            family("mstar_host_arena_bytes_in_use", "gauge",
                   "Bytes of the workers' host arenas holding outputs on their way to the event loop.",
                   [((("device", w.name),), w.arena.in_use_bytes) for w in workers
                    if getattr(w, "arena", None) is not None]),
            family("mstar_worker_seconds_total", "counter",
                   "A worker thread's time in decode group steps, by phase: launch (planning, graph replay, "
                   "bookkeeping), finalize (stop rules, emits, routing), wait (blocked on the device), mixed "
                   "(reading and routing the new rows of mixed steps, a wait for their step included).",
                   [((("device", w.name), ("phase", ph)), getattr(w.stats, f"{ph}_s")) for w in workers
                    for ph in ("launch", "finalize", "wait", "mixed")]),
            family("mstar_worker_cpu_seconds_total", "counter",
                   "A worker thread's CPU time in the launch and finalize phases of decode group steps, its waits "
                   "for the device included (the driver spins while it waits): what the launch, finalize and wait "
                   "phases of mstar_worker_seconds_total add up to beyond it, the thread was ready but not running "
                   "(another thread held the GIL, or the OS ran something else).",
                   [((("device", w.name), ("phase", ph)), getattr(w.stats, f"{ph}_cpu_s")) for w in workers
                    for ph in ("launch", "finalize")]),
            family("mstar_mixed_steps_total", "counter",
                   "Decode group steps that took new rows' prompt tokens in, eager or as a CUDA graph.",
                   [((("device", w.name), ("graph", g)), n) for w in workers
                    for g, n in (("0", w.stats.mixed_steps - w.stats.mixed_graph_steps),
                                 ("1", w.stats.mixed_graph_steps))]),
            family("mstar_mixed_rows_total", "counter", "New rows that mixed steps took in.",
                   [((("device", w.name),), w.stats.mixed_rows) for w in workers]),
            family("mstar_worker_steps_total", "counter", "Steps a worker ran.",
                   [((("device", w.name),), w.stats.steps) for w in workers]),
            family("mstar_event_loop_lag_seconds", "histogram",
                   "How late the event loop runs a callback it scheduled (every 10 ms): the time it was busy.",
                   self.loop_lag),
            family("mstar_gc_pause_seconds", "histogram",
                   "Python's garbage collections by generation: every thread waits each one out.", self.gc_pauses),
        ]
        return "".join(parts)
