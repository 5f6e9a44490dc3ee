"""Workers' step reports into requests' output chunks, on the event loop:
each emitted batch is fed to its requests (text tokens detokenised, stop
strings and host stop rules judged there), stops go back to
the workers that run the parts that stopped, and a request ends once every
worker it ran on has finished it. Hooks observe every report, before and
after it is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Callable

from mstar.engine.eventloop.metrics import STATUSES, EngineMetrics
from mstar.engine.eventloop.pcm import pcm16
from mstar.engine.eventloop.requests import RequestState
from mstar.engine.eventloop.waiting_line import WaitingLine
from mstar.engine.eventloop.worker_load import WorkerLoad
from mstar.engine.messages import Abort, EmitBatch, Finished, StepReport, Stop
from mstar.graph import Emit, WalkPlan

if TYPE_CHECKING:
    from mstar.engine.worker.device_worker import DeviceWorker


class ReportReader:
    def __init__(self, states: dict[str, RequestState], waiting: WaitingLine, stats: Counter[str],
                 metrics: EngineMetrics, drop_owner: Callable[[str], None]) -> None:
        """`states`: the running requests by id, the engine's; a request read
        to its end leaves it here. `drop_owner`: the tensor store's, for what
        one worker sent another for a request and nobody took."""
        self._states = states
        self._waiting = waiting
        self._stats = stats
        self._metrics = metrics
        self._drop_owner = drop_owner
        self._report_hooks: list[Callable[[StepReport], None]] = []
        self._pre_hooks: list[Callable[[StepReport], None]] = []
        self._plans: dict[str, WalkPlan] = {}
        self._workers: Sequence[DeviceWorker] = []
        self._load: WorkerLoad | None = None

    def serve(self, plans: dict[str, WalkPlan], workers: Sequence[DeviceWorker], load: WorkerLoad) -> None:
        """The walks, workers and load of the engine that starts: what its reports name."""
        self._plans = plans
        self._workers = workers
        self._load = load

    def add_hook(self, hook: Callable[[StepReport], None], before: bool = False) -> None:
        (self._pre_hooks if before else self._report_hooks).append(hook)

    def remove_hook(self, hook: Callable[[StepReport], None]) -> None:
        for hooks in (self._pre_hooks, self._report_hooks):
            if hook in hooks:
                hooks.remove(hook)

    def read(self, report: StepReport) -> None:
        for hook in self._pre_hooks:
            hook(report)
        if report.started:  # before the step's tokens below: a prompt step draws its rows' first
            self._metrics.started(report.started)
        if report.sampled:
            self._count_sampled(report.sampled)
        for batch in report.emits:
            self._read_batch(batch)
        for fin in report.finished:
            assert self._load is not None  # `serve` runs before any worker does
            self._on_finished(fin, self._load.index(report.device))
        for waiting in report.awaiting:
            state = self._states.get(waiting.request_id)
            if state is not None and not state.finished:
                state.awaiting(waiting.context_tokens)
        for hook in self._report_hooks:
            hook(report)
        for batch in report.emits:
            batch.release()  # read (hooks included): its arena blocks go back

    def _read_batch(self, batch: EmitBatch) -> None:
        """One emitted value's rows into their requests (a decode step's: one row for each running request)."""
        emit = self._emit_of(batch.value)
        if emit.modality == "audio":
            data: list = pcm16(batch.data)
        else:
            data = batch.data.tolist() if hasattr(batch.data, "tolist") else [
                t if isinstance(t, list) else t.tolist() for t in batch.data]
        logprobs = repeat(None) if batch.logprobs is None else batch.logprobs.tolist()
        text = emit.modality == "text"
        states, value = self._states, batch.value
        # reading a report only takes requests off the waiting line: one empty now stays empty for the batch
        waiting = self._waiting if self._waiting else None
        fed = 0
        for rid, part, row, logprob in zip(batch.request_ids, batch.partitions, data, logprobs):
            state = states.get(rid)
            if state is None or state.finished or part in state.stopped:
                self._stats["outputs_dropped"] += 1
                continue
            if waiting is not None:
                waiting.started(rid)
            if text and isinstance(row, int):
                fed += 1
                stop = self._feed_token(state, part, row, logprob, value)
            elif text and isinstance(row, list):  # a launch of several steps: the row's tokens in order
                taken, stop = self._feed_run(state, part, row, value)
                fed += taken
            else:
                stop = (state.feed_value(part, value, emit.modality, row, emit.sample_rate)
                        or self._host_stop(state, part, value, row))
            if stop:
                self._workers[state.worker_of(part)].send(Stop(rid, part))
        if fed:  # the text tokens taken in, counted as they come: one call a batch, not one a token
            self._metrics.generated(fed)
        self._metrics.outputs(batch.request_ids, emit.modality)

    def _count_sampled(self, request_ids: list[str]) -> None:
        """Tokens the workers drew that reach no client as tokens (a speech
        walk's audio codes), one request id each: counted now, and in each
        running request's share, which its end does not count again."""
        states = self._states
        n = 0
        for rid in request_ids:
            state = states.get(rid)
            if state is not None:
                state.unseen_tokens += 1
                n += 1
        self._metrics.generated(n)
        self._metrics.drawn(request_ids)  # one `if` unless some request still waits for its first token

    def _emit_of(self, value: str) -> Emit:
        for plan in self._plans.values():
            if value in plan.emits:
                return plan.emits[value]
        return Emit(value)

    def _feed_token(self, state: RequestState, part: str, token: int, logprob: list[float] | None,
                    value: str) -> bool:
        """One text token (and its packed logprobs, if its step computed
        any) into its request; whether the request's part stops there."""
        detok = state.detok
        text = detok.push((token,)) if detok is not None and token not in state.hidden_ids else ""
        return state.feed_token(part, token, text, logprob) or self._host_stop(state, part, value, token)

    def _feed_run(self, state: RequestState, part: str, tokens: list[int], value: str) -> tuple[int, bool]:
        """Several text tokens of one launch into their request, as one chunk
        where nothing is checked between them; else one at a time, up to a
        stop string's match (the tokens after it are dropped, as a later
        step's are). How many it took, and whether the part stops."""
        if state.stops.stops or state.host_predicates:
            for n, token in enumerate(tokens, 1):
                if self._feed_token(state, part, token, None, value):
                    self._stats["outputs_dropped"] += len(tokens) - n
                    return n, True
            return len(tokens), False
        detok, hidden = state.detok, state.hidden_ids
        shown = [t for t in tokens if t not in hidden] if hidden else tokens
        # a push a token, as one step a launch pushes them: a run pushed whole would hold back its complete
        # characters while its last one is incomplete
        text = "".join([detok.push((t,)) for t in shown]) if detok is not None else ""
        state.feed_run(part, tokens, text)
        return len(tokens), False

    @staticmethod
    def _host_stop(state: RequestState, part: str, value: str, data: object) -> bool:
        return bool(state.host_predicates) and state.host_stop(part, value, data)

    def _on_finished(self, fin: Finished, worker: int) -> None:
        state = self._states.get(fin.request_id)
        if state is None or not fin.request_done:
            return
        # one worker is done with the request; the request is done when all of its workers are
        assert self._load is not None
        self._load.finished(worker, worker == state.worker)
        reason = state.shard_done(fin.reason, fin.error, fin.generated, worker)
        if fin.reason == "error" and not state.finished and state.shards_left > 0:  # so does the request
            for w in state.shards:
                if w != worker:
                    self._workers[w].send(Abort(fin.request_id, "error"))
        if reason is None:
            return
        del self._states[fin.request_id]
        if len(state.shards) > 1:
            self._drop_owner(fin.request_id)  # references one worker sent another and nobody took
        if state.timer is not None:
            state.timer.cancel()
        self._waiting.started(fin.request_id)
        # finished first: its held-back text may complete a stop string, which is then how it ended
        status = state.finish(reason if reason in STATUSES else "stop", state.failed or fin.error)
        self._stats[f"finished_{status if reason in STATUSES else reason}"] += 1
        self._metrics.finished(fin.request_id, status, state.num_prompt_tokens, state.num_output_tokens,
                               state.num_counted)
