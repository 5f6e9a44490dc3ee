"""Messages between the event loop and the device workers.

Into a worker's inbox: `Submit`, `Append` and `CloseInput` (input that keeps
arriving), `Stop` (one partition of a request, keyed by (request,
partition)), `Abort` (a whole request), `Unstarted` (at shutdown: which of
some requests never ran here), `Shutdown`, and from other workers
`Forward` (stream items of a request whose partitions run on several
devices). Out of a worker, once per
step for the whole batch: a `StepReport`.
"""

from __future__ import annotations

import concurrent.futures

from dataclasses import dataclass, field

import torch

from mstar.graph import WalkPlan
from mstar.types import SamplingParams


@dataclass(eq=False)
class Submit:
    request_id: str
    walk: WalkPlan
    values: dict[str, torch.Tensor]
    # by sampling key (the root partition's name, or another partition's that samples); each with its seed
    sampling: dict[str, SamplingParams]
    stop_ids: dict[str, tuple[int, ...]]  # by key: ids that end token loops (EOS unless ignore_eos, stop_token_ids)
    more_input: bool = False    # the walk's `more_input` keeps arriving (`Append`) until `CloseInput`
    # the worker (index) of each partition, when they are not all on the one that gets this Submit; each
    # worker of the request gets a Submit, and only the root's worker gets `values`
    places: dict[str, int] | None = None
    priority: int = 0           # the request's: lower is served first among waiting rows
    sent_at: float | None = None  # `time.monotonic()` when the event loop sent it (`BurstGate`)


@dataclass(frozen=True)
class Append:
    """One more piece of a running request's `more_input`: values by walk
    input name (CPU tensors: token ids, audio, positions)."""

    request_id: str
    values: dict[str, torch.Tensor]
    num_tokens: int = 0   # the piece's prompt tokens: the room the turn before it leaves in the context


@dataclass(frozen=True)
class CloseInput:
    """No more input for the request: it ends after the pieces it has."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """The event loop decided that a partition is done (e.g. a stop string)."""

    request_id: str
    partition: str


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Unstarted:
    """Which of `request_ids` are still queued here with none of their rows
    ever admitted (no KV pages, no state slot, nothing sampled): `done` gets
    that set. The drain at shutdown refuses those at once instead of letting
    them wait out the grace."""

    request_ids: frozenset[str]
    done: concurrent.futures.Future


@dataclass
class Profile:
    """Run torch's profiler on the worker thread for `seconds`, then resolve
    `done` with the finished profiler (its `key_averages()`, traces);
    `stacks`: record each op's Python stack too (slower)."""

    seconds: float
    done: concurrent.futures.Future
    stacks: bool = False


@dataclass(eq=False)
class EmitBatch:
    """Values written by one step that reach clients: row i of `data` belongs
    to (`request_ids[i]`, `partition[i]`). `data` is on the CPU, and so are
    `logprobs`: sampled tokens' logprobs, a row per row of `data`, packed as
    `sampler.token_logprobs` packs them (None when no row asked)."""

    value: str
    request_ids: list[str]
    partitions: list[str]
    data: torch.Tensor | list[torch.Tensor] | list[list[int]]  # the last: each row's token ids of a launch
    blocks: list = field(default_factory=list)  # arena blocks under `data`: released once the engine read it
    logprobs: torch.Tensor | None = None

    def release(self) -> None:
        for block in self.blocks:
            block.release()
        self.blocks = []


@dataclass(frozen=True)
class Finished:
    """A partition is done; `request_done` when it was the request's last."""

    request_id: str
    partition: str
    reason: str                 # stop | length | abort | error
    request_done: bool
    error: str | None = None
    # with request_done: the tokens each of the request's partitions on this worker sampled
    generated: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class StreamStart:
    """The producer wrote its first item into consumer `consumer`, which
    starts with `values` (the producer's values it reads: tensor references
    on `Forward.device`); its items follow in the same `Forward`."""

    request_id: str
    consumer: str
    values: dict


@dataclass(eq=False)
class StreamItems:
    """Items a producer on another worker wrote into stream consumer
    `consumer`: token ids, or references to tensors on `Forward.device`."""

    request_id: str
    consumer: str
    items: list


@dataclass(frozen=True)
class StreamSegment:
    """The producer ended a turn: the consumer cuts its tail and counts anew."""

    request_id: str
    consumer: str


@dataclass(frozen=True)
class StreamEnd:
    """The producer finished (`reason`: the request's reason so far)."""

    request_id: str
    consumer: str
    reason: str


@dataclass(eq=False)
class Forward:
    """What one worker's step sends another, in order. `ready` (CUDA) is
    recorded on the sender's stream after the work that wrote the tensors."""

    device: str
    items: list[StreamItems | StreamSegment | StreamEnd]
    ready: object = None  # torch.cuda.Event | None


@dataclass(frozen=True)
class Awaiting:
    """A request taking more input has run every piece it was given;
    `context_tokens`: what its root partition's context holds now (what it
    was given and what it wrote), which the next piece must fit beside."""

    request_id: str
    context_tokens: int = 0


@dataclass(eq=False)
class StepReport:
    """What one worker step (or one inbox pass) tells the event loop."""

    device: str
    emits: list[EmitBatch] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    awaiting: list[Awaiting] = field(default_factory=list)
    component: str = ""
    mode: str = ""
    rows: int = 0
    steps: int = 1          # decode steps the launch ran back to back (`step_s` and `device_s` cover them all)
    step_s: float = 0.0     # the whole step on the worker
    device_s: float = 0.0   # of which forward and sampling; the rest is host work
    # a request id for each token the step sampled that no emit brings to the event loop (a speech walk's audio
    # codes, which a codec takes on the worker): counted as they are drawn, as the text tokens of `emits` are
    sampled: list[str] = field(default_factory=list)
    # (request id, `time.perf_counter()` at its step's start) of each request whose first work item
    # (`WorkItem.first_step`) this report's step ran: its queue time ends there (workers are threads of the event
    # loop's process: one clock). Per request, as a batch whose rows name their outputs differently runs as
    # several calls into one report, each beginning when the one before it ended.
    started: list[tuple[str, float]] = field(default_factory=list)

    def empty(self) -> bool:
        return not self.emits and not self.finished and not self.awaiting and not self.sampled and not self.started
