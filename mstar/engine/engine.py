"""The Engine: the asyncio side of the runtime and its public API.

`submit` looks up a request's walk, has the model prepare it (inputs,
tokenised and templated there, sampling per key, validated there once) and
hands it to its device workers; it returns a `RequestStream` of output
chunks. `prepare` does the same preparing ahead, off the event loop for a
long prompt, for a `submit` that starts from it. Workers report once per step
through `loop.call_soon_threadsafe` to the `ReportReader`, which turns each
report into chunks for the requests in it, applies stop strings, and sends
stops and aborts back. The placement says which devices run which
components (a replica of the whole model on each, or the model split across
them); `WorkerLoad` sends a new request's partitions to as few workers as it
can, the least loaded live ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections import Counter
from types import MappingProxyType
from typing import Callable

import structlog
import torch

from mstar.config import EngineConfig
from mstar.engine.execution.components import resolve_dtype
from mstar.engine.eventloop.devices import check_devices
from mstar.engine.messages import Abort, Append, CloseInput, Profile, Shutdown, StepReport, Submit, Unstarted
from mstar.engine.eventloop.metrics import EngineMetrics, GCPauses, LagMonitor
from mstar.engine.eventloop.report_reader import ReportReader
from mstar.engine.eventloop.requests import RequestState, RequestStream
from mstar.engine.eventloop.worker_load import WorkerLoad
from mstar.engine.movement.tensor_store import TensorStore
from mstar.engine.eventloop.waiting_line import WaitingLine, shutting_down
from mstar.engine.worker.device_worker import DeviceWorker
from mstar.engine.worker.turns import TURN_MARGIN
from mstar.engine.worker.walker import check_runnable
from mstar.errors import SHUTTING_DOWN, ConfigError, MstarError, ModelNotFound, RequestError
from mstar.graph import WalkPlan, compile_walks
from mstar.models.base import Model
from mstar.models.prepared import Prepared, check_roles, input_size
from mstar.models.registry import load_model
from mstar.models.tokenizer import IncrementalDetokenizer
from mstar.placement import describe, resolve
from mstar.scheduler import LaunchSteps
from mstar.types import GenerateRequest, ModelCard

log = structlog.get_logger("mstar.engine")

REFUSE_WAIT_S = 1.0  # how long a drain waits for the workers to say which requests never ran
OFF_LOOP_SIZE = 1 << 16  # inputs from this size on (characters, ids) are prepared on a thread


class Engine:
    def __init__(self, config: EngineConfig, model: Model | None = None) -> None:
        """`model`: an already built model file (tests, embedding); by default
        the engine loads `config.model` when it starts."""
        self.config = config
        self.store = TensorStore()
        self.model: Model | None = model
        self.plans: dict[str, WalkPlan] = {}
        self.workers: list[DeviceWorker] = []
        self.stats: Counter[str] = Counter()
        self._states: dict[str, RequestState] = {}
        self._waiting = WaitingLine(config.max_waiting_requests, config.queue_timeout, self.stats)
        self._load: WorkerLoad | None = None  # the workers', from `start`
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics = EngineMetrics()
        self._reports = ReportReader(self._states, self._waiting, self.stats, self._metrics, self.store.drop_owner)
        self._lag: LagMonitor | None = None
        self._gc = GCPauses(self._metrics.gc_pauses)
        self._switch_interval: float | None = None  # Python's, to restore at shutdown
        self._draining = False  # shutting down: running requests may finish, new ones are refused
        self._drained = False   # the drain aborted what ran: a request submitted now would outlive it
        self._card: ModelCard | None = None
        self.add_report_hook(self._metrics.on_report)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._card = None
        cfg = self.config
        check_devices(cfg.devices)
        if self.model is None:
            self.model = await self._loop.run_in_executor(
                None, lambda: load_model(cfg.model, cfg.load_format, cfg.max_model_len, cfg.generation_config))
        self.plans = compile_walks(self.model.walks, self.model.components)
        check_runnable(self.plans, self.model.components)
        check_roles(self.model, self.plans)
        if cfg.audio_logits_only:  # the heads compute no text ids' logits: walks that write text are not served
            self.plans = {name: self.plans[name] for name in self.model.audio_only_walks()}
        self.placement = resolve(cfg.placement, cfg.devices, self.model.components, self.plans,
                                 self.model.split_placement(len(cfg.devices)))
        devices = [d for d in cfg.devices if self.placement.on(d)]
        # several decode steps a launch pay only where a walk's tokens go to a consumer, not to the client
        streamed = any(value not in plan.emits for plan in self.plans.values() for value in plan.streams)
        steps = LaunchSteps.of(cfg.scheduler.num_scheduler_steps, streamed)
        self.workers = [DeviceWorker(d, self.model, cfg, self.store, self._post, self.placement.on(d), i, steps)
                        for i, d in enumerate(devices)]
        for w in self.workers:
            w.link.peers = self.workers
        self._load = WorkerLoad(self.workers, self.placement)
        self._reports.serve(self.plans, self.workers, self._load)
        for w in self.workers:
            w.start()
        for w in self.workers:
            await self._loop.run_in_executor(None, w.ready.wait)
        failed = [w for w in self.workers if w.error is not None]
        if failed:
            await self.shutdown()
            error = failed[0].error
            if isinstance(error, ConfigError):  # a checkpoint that does not load: the message says it all
                raise error
            raise MstarError(f"worker on {failed[0].name} failed to start: {type(error).__name__}: {error}") from error
        if cfg.gil_switch_interval_ms is not None:  # set once started: a start that fails leaves it as it was
            # a worker waiting for the GIL waits up to this long for whoever holds it (Python's default 5 ms)
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(cfg.gil_switch_interval_ms / 1000)
        self._lag = LagMonitor(self._metrics.loop_lag)
        self._lag.start()
        dtype = resolve_dtype(self.model, cfg, torch.device(devices[0]))
        log.info("engine started", model=self.model_name, random_weights=self.model.random_weights,
                 dtype=str(dtype).removeprefix("torch."), max_model_len=self.model.max_model_len,
                 devices=list(cfg.devices), placement=describe(self.placement))
        self._gc.start()  # last: a start that raises leaves no hook behind

    async def shutdown(self) -> None:
        if self._lag is not None:
            self._lag.stop()
        self._gc.stop()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        for w in self.workers:
            w.send(Shutdown())
        loop = asyncio.get_running_loop()
        for w in self.workers:
            await loop.run_in_executor(None, w.join, 10.0)
        for state in list(self._states.values()):
            state.finish("abort", "the engine shut down")
        self._states.clear()
        self._waiting.clear()

    async def drain(self, grace: float, busy: Callable[[], bool] | None = None) -> int:
        """Refuse new requests, and those submitted that never ran (queued
        behind the running ones: `_refuse_unstarted`); let the running ones
        finish for up to `grace` seconds, then abort the rest: their streams
        end with an "abort" that the routes turn into an error event. `busy`: whether requests admitted
        before the drain have yet to reach the engine (a body still arriving);
        they are waited for too. Returns how many were aborted."""
        self._draining = True
        self._waiting.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self._refuse_unstarted(min(REFUSE_WAIT_S, grace))
        while (self._states or (busy is not None and busy())) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._states)
        self._drained = True
        for request_id in left:
            self.abort(request_id)
        if left:
            log.warning("aborted requests still running at shutdown", requests=len(left), grace_s=grace)
        return len(left)

    async def _refuse_unstarted(self, wait: float) -> int:
        """A drain's first act: the requests that produced nothing and whose
        worker never ran them (queued behind the running ones) end at once,
        refused as the server is shutting down (the routes answer 503 with
        Retry-After: another server may take them); only the requests that
        started get the grace. A worker that does not answer within `wait`
        seconds (a long step) leaves its requests the grace. Returns how many
        were refused."""
        asked: dict[int, list[str]] = {}
        for rid, state in self._states.items():
            if rid in self._waiting and not state.finished and self.workers[state.worker].alive:
                asked.setdefault(state.worker, []).append(rid)
        answers = []
        for w, ids in asked.items():
            done: concurrent.futures.Future = concurrent.futures.Future()
            self.workers[w].send(Unstarted(frozenset(ids), done))
            answers.append(asyncio.wrap_future(done))
        if not answers:
            return 0
        ready, late = await asyncio.wait(answers, timeout=wait)
        for answer in late:  # a worker busy past the wait: its requests keep the grace
            answer.cancel()
        refused = 0
        for answer in ready:
            for rid in answer.result():
                state = self._states.get(rid)
                if state is None or state.finished or rid not in self._waiting:
                    continue  # it ended, or produced its first output, meanwhile
                self.stats["requests_refused_at_shutdown"] += 1
                self._metrics.refused += 1
                self._end(state, SHUTTING_DOWN)
                refused += 1
        if refused:
            log.info("refused requests that had not started", requests=refused)
        return refused

    # -------------------------------------------------------------- queries

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    def _model(self, name: str | None) -> Model:
        if self.model is None:
            raise MstarError("the engine has not started")
        if name not in (None, self.model_name, self.config.model, *self.config.served_model_aliases):
            raise ModelNotFound(str(name))
        return self.model

    def tokenizer(self, model: str):
        tok = self._model(model).tokenizer
        if tok is None:
            raise RequestError(f"model '{model}' has no tokenizer", field="model")
        return tok

    def model_cards(self) -> list[ModelCard]:
        if self._card is None:  # what it says is fixed once the engine started; every request reads it
            m = self._model(None)
            placed = self.placement.components()
            # a tts walk's root samples under its own key, whose defaults are not the model's root defaults
            tts = m.default_sampling(self.plans[m.tts_walk].root) if m.tts_walk is not None else m.default_sampling()
            self._card = ModelCard(self.model_name, m.max_model_len, tuple(self.plans), m.default_walk, placed,
                                   tuple(m.voices), m.default_sampling(), tuple(m.input_modalities), m.tts_walk,
                                   m.spoken_chat_walk, tts, m.early_tts_walk, m.written_walk, m.spoken_audio_key,
                                   self.config.served_model_aliases, self.config.model,
                                   MappingProxyType(dict(m.text_defaults)))
        return [self._card]

    async def profile(self, seconds: float, worker: int = 0, stacks: bool = False) -> torch.profiler.profile:
        """torch's profiler over `seconds` of worker `worker`'s thread (its
        steps' CPU ops and, on CUDA, their kernels; with `stacks`, each op's
        Python stack). Raises `ProfilerBusy` while another profile runs in
        the process, RuntimeError when the worker is not running."""
        if not self.workers[worker].alive:
            raise RuntimeError(f"the worker on {self.workers[worker].name} is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.workers[worker].send(Profile(seconds, done, stacks))
        return await asyncio.wrap_future(done)

    def health(self) -> dict:
        ok = bool(self.workers) and all(w.alive for w in self.workers)
        return {
            "status": "ok" if ok else "unhealthy",
            "model": self.model_name,
            # what a client may ask of this server: --audio-logits-only leaves only the speech walks
            "walks": sorted(self.plans),
            "audio_logits_only": self.config.audio_logits_only,
            "devices": [{"device": w.name, "alive": w.alive, "components": w.components,
                         "kv_pages_in_use": w.pages_in_use(), "prefix_cache": w.prefix_caches(),
                         "state_slots": w.state_slots()}
                        for w in self.workers],
            "placement": describe(self.placement) if self.workers else {},
            "requests_running": len(self._states),
            "tensors_held": len(self.store),
        }

    def pages_in_use(self) -> int:
        return sum(sum(w.pages_in_use().values()) for w in self.workers)

    def num_running(self) -> int:
        return len(self._states)

    def metrics_text(self) -> str:
        """The engine's metrics in the Prometheus text format 0.0.4."""
        return self._metrics.render(self.workers, len(self._states), len(self.store),
                                    self.stats["outputs_dropped"])

    # --------------------------------------------------------------- submit

    async def prepare(self, request: GenerateRequest) -> Prepared:
        """What `submit` starts `request` from: the engine's checks, then the
        model's `prepare` (a language model tokenises and templates its
        prompt there), on a thread when the inputs are large: tokenising a
        long prompt on the event loop would stall every other client
        meanwhile. Bad input raises `RequestError`."""
        model, plan = self._intake(request)
        if input_size(request.inputs) < OFF_LOOP_SIZE:
            return model.prepare(request, plan)
        return await asyncio.to_thread(model.prepare, request, plan)

    def submit(self, request: GenerateRequest, prepared: Prepared | None = None) -> RequestStream:
        """Start a request from `prepared`: what `prepare` gave for it, or for
        another request of the same inputs and walk (a second sample of one
        prompt: its own sampling is resolved again, its inputs are not), or
        by default what the model prepares here, on the event loop. Bad input
        raises `RequestError` here, before anything is queued."""
        if self._drained:  # admitted before the drain, its body or prompt took longer than the grace
            raise shutting_down()
        model, plan = self._intake(request)
        if prepared is None:
            prepared = model.prepare(request, plan)
        elif prepared.walk != plan.name:
            raise ValueError(f"request '{request.request_id}' is for walk '{plan.name}', but what it was given was "
                             f"prepared for walk '{prepared.walk}'")
        elif not prepared.is_sampling_of(request):
            prepared = model.resample(request, plan, prepared)
        assert self._load is not None  # set by `start`, which `_intake` checked ran
        places = self._load.route(plan)
        idx = places[plan.root]
        tok = model.tokenizer
        sampling = prepared.sampling[plan.root]
        state = RequestState(request.request_id, plan, sampling, prepared.num_prompt_tokens, idx,
                             IncrementalDetokenizer(tok, sampling.skip_special_tokens) if tok is not None else None,
                             host_predicates=plan.host_predicates, request=request, places=places,
                             stop_token_ids=frozenset(prepared.stop_ids[plan.root]),
                             eos_ids=frozenset() if sampling.ignore_eos else frozenset(model.eos_ids(plan.root)))
        self._states[request.request_id] = state
        self._waiting.add(request.request_id)
        self.stats["requests_submitted"] += 1
        self._metrics.submitted(request.request_id)
        shared = places if len(state.shards) > 1 else None
        self._load.started(idx, state.shards)
        # the root's worker gets the inputs; the others start their partitions. The root's goes last: its worker
        # may run the request's first steps and forward their streams at once, and a worker that has no Submit
        # for a request drops what is forwarded for it (`Streams._local`)
        sent_at = time.monotonic()
        for w in sorted(state.shards, key=lambda w: w == idx):
            self.workers[w].send(Submit(request.request_id, plan, prepared.values if w == idx else {},
                                        prepared.sampling, prepared.stop_ids, request.more_input, shared,
                                        request.priority, sent_at))
        if self.config.request_timeout > 0:
            state.timer = asyncio.get_running_loop().call_later(self.config.request_timeout, self._expire,
                                                                request.request_id)
        return RequestStream(state, self.abort)

    def _intake(self, request: GenerateRequest) -> tuple[Model, WalkPlan]:
        """The model and walk plan of a request the engine can take now."""
        model = self._model(request.model)
        if not self.workers or not any(w.alive for w in self.workers):
            raise RequestError("the engine is not running", status=503, code="unavailable")
        if request.request_id in self._states:
            raise RequestError(f"request id '{request.request_id}' is already running", field="request_id")
        walk_name = model.walk_for(request)
        plan = self.plans.get(walk_name)
        if plan is None:
            why = "is not served: --audio-logits-only serves" if walk_name in model.walks else "is unknown; it has"
            raise RequestError(f"walk '{walk_name}' of model '{self.model_name}' {why} {', '.join(self.plans)}",
                               field="walk")
        if request.more_input and plan.more_input is None:
            raise RequestError(f"walk '{walk_name}' of model '{self.model_name}' takes no input while it runs",
                               field="input")
        return model, plan

    def append(self, request_id: str, inputs: dict) -> int:
        """More input for a running request submitted with `more_input` (for
        a speech model: `{"text": ...}`): it runs as the next turn, after what
        the request has already. Returns the piece's token count. Raises
        `RequestError` for bad input or a request that takes no more."""
        state = self._states.get(request_id)
        if state is None or state.finished:
            raise RequestError(f"request '{request_id}' is not running", field="request_id", status=404)
        if not state.input_open:
            raise RequestError(f"request '{request_id}' takes no more input", field="input")
        model = self._model(None)
        piece = model.prepare_more(state.request, inputs)
        n = piece.num_tokens
        held = max(state.num_prompt_tokens + state.num_output_tokens, state.context_floor)
        # refused here, while the client can still be told: a turn under way is cut to leave the piece room
        # (`Turns`), and each of the two must still be able to answer
        turns = 1 if state.between_turns else 2
        if held + n + TURN_MARGIN + turns * model.min_turn_tokens > model.max_model_len:
            raise RequestError(f"{n} more tokens on top of the {held} the request has would leave the turns too "
                               f"little room to answer (at least {model.min_turn_tokens} tokens each) in the "
                               f"model's context of {model.max_model_len} tokens", field="input")
        state.between_turns = False
        state.num_prompt_tokens += n
        state.context_floor += n
        self.workers[state.worker].send(Append(request_id, dict(piece.values), n))
        return n

    def close_input(self, request_id: str) -> None:
        """No more input: the request ends once it has run what it was given.
        Idempotent; a request that has ended is left alone."""
        state = self._states.get(request_id)
        if state is None or not state.input_open:
            return
        state.input_open = False
        self.workers[state.worker].send(CloseInput(request_id))

    def _expire(self, request_id: str) -> None:
        """The request outlived --request-timeout: it ends with "timeout" and
        the worker frees what it holds."""
        state = self._states.get(request_id)
        if state is None or state.finished:
            return
        self._metrics.forget(request_id)  # counted when the worker confirms the request is gone
        state.finish("timeout", f"the request ran past the server's limit of {self.config.request_timeout:g} s "
                                "(--request-timeout)")
        for w in state.shards:
            self.workers[w].send(Abort(request_id, "timeout"))

    async def admit(self, timeout: float | None = None) -> None:
        """Wait for room in the waiting line (`WaitingLine.admit`: a 429 after
        `timeout`, default the configured queue timeout). An unhealthy engine
        answers 503 at once."""
        if not self.workers or not any(w.alive for w in self.workers):
            raise RequestError("the engine is not running", status=503, code="unavailable", retry_after=5)
        if self._draining:
            raise shutting_down()
        try:
            await self._waiting.admit(timeout)
        except RequestError:
            self._metrics.refused += 1
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; idempotent."""
        state = self._states.get(request_id)
        if state is None:
            return
        if not state.finished:
            self.stats["requests_aborted"] += 1
        self._end(state)

    def _end(self, state: RequestState, error: str | None = None) -> None:
        """End `state`'s stream with "abort" (and `error`), if it is still open,
        and tell every worker running a part of it to let it go."""
        if not state.finished:
            self._metrics.forget(state.request_id)
            state.finish("abort", error)
        for w in state.shards:
            self.workers[w].send(Abort(state.request_id))

    # -------------------------------------------------------- worker reports

    def _post(self, report: StepReport) -> None:
        """Called on a worker thread, once per step."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._reports.read, report)

    def add_report_hook(self, hook: Callable[[StepReport], None],
                        before: bool = False) -> Callable[[StepReport], None]:
        """Observe every step report on the event loop (metrics, tests), after
        the engine has handled it or, with `before`, just before. Returns
        `hook`, for `remove_report_hook`."""
        self._reports.add_hook(hook, before)
        return hook

    def remove_report_hook(self, hook: Callable[[StepReport], None]) -> None:
        self._reports.remove_hook(hook)

