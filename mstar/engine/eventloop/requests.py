"""Request state on the event loop side: the client's stream of output
chunks, incremental detokenising, stop strings, and the stops that the event
loop sends back to the workers.

`RequestState.feed` takes the values a step emitted for this request and turns
them into `OutputChunk`s; `finish` closes the stream once.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from mstar.graph import WalkPlan
from mstar.types import FinishReason, GenerateRequest, OutputChunk, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from mstar.models.tokenizer import IncrementalDetokenizer


class StopStrings:
    """Finds the first stop string in streamed text and holds back any tail
    that could still become one. Text pushed before the stops are armed (a
    `min_tokens` not reached, as vLLM) is never matched on its own: a stop
    string counts only where it ends in armed text."""

    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        """`keep`: the text that ends at a stop string keeps it."""
        self.stops = stops
        self.keep = keep
        self.text = ""
        self.sent = 0
        self.armed_at = 0  # where armed text starts
        self.matched: str | None = None  # the stop string that cut the text, once one has
        # per stop, the longest suffix of the text that is a proper prefix of it: a push of k characters can
        # lengthen it by k at most, so the next search starts there instead of at the stop's whole length
        self._tails = [0] * len(stops)

    def push(self, new: str, armed: bool = True) -> tuple[str, bool]:
        """Text that is safe to send now, and whether a stop string matched
        (the text is then cut before it)."""
        if not self.stops:
            return new, False
        start = max(0, self.sent - max(len(s) for s in self.stops) + 1)
        self.text += new
        if not armed:
            self.armed_at = len(self.text)
            hits = []
        else:
            # each stop's first match that ends in armed text: a shorter stop may start at the same place and
            # end before it, so the stop is the one found there, not any that starts there
            hits = [(i, s) for i, s in ((self.text.find(s, max(start, self.armed_at - len(s) + 1)), s)
                                        for s in self.stops) if i >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])  # the earliest; of those, the first stop given
            if self.keep:
                cut += len(self.matched)
            out = self.text[self.sent:cut] if cut > self.sent else ""
            self.sent = max(self.sent, cut)
            self._tails = [len(s) for s in self.stops]  # not tracked past a match: a later search is a full one
            return out, True
        safe = len(self.text) - self._held_tail(len(new))
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _held_tail(self, pushed: int) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop."""
        for i, s in enumerate(self.stops):
            tail = 0
            for n in range(min(len(s) - 1, len(self.text), self._tails[i] + pushed), 0, -1):
                if self.text.endswith(s[:n]):
                    tail = n
                    break
            self._tails[i] = tail
        return max(self._tails, default=0)


class ChunkQueue:
    """A request's chunks on their way to its one reader: `asyncio.Queue`'s
    put and get without its bounds, getter lists and per-put wakeup
    bookkeeping (a step puts a chunk for every running request, all on the
    event loop)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[OutputChunk] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, chunk: OutputChunk) -> None:
        self._items.append(chunk)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> OutputChunk:
        return self._items.popleft()

    async def get(self) -> OutputChunk:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


@dataclass(eq=False)
class RequestState:
    request_id: str
    walk: WalkPlan
    sampling: SamplingParams
    num_prompt_tokens: int
    worker: int
    detok: IncrementalDetokenizer | None
    host_predicates: Mapping[tuple[str, str], Callable[[object], bool]] = field(default_factory=dict)  # the plan's
    queue: ChunkQueue = field(default_factory=ChunkQueue)
    num_output_tokens: int = 0
    finished: bool = False
    stopped: set[str] = field(default_factory=set)   # partitions the event loop has stopped
    stop_reason: FinishReason | None = None
    request: GenerateRequest | None = None  # as submitted: what later input inherits
    places: dict[str, int] = field(default_factory=dict)  # partition -> worker index
    stop_token_ids: frozenset[int] = frozenset()  # the ids that end its text (EOS, `stop_token_ids`)
    eos_ids: frozenset[int] = frozenset()  # the model's EOS ids among them (none with `ignore_eos`)
    stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self.stops = StopStrings(self.sampling.stop, self.sampling.include_stop_str_in_output)
        self.timer: asyncio.TimerHandle | None = None  # the --request-timeout deadline
        self.input_open = self.request is not None and self.request.more_input
        # the workers running its partitions; it is done when each has reported its part done
        self.shards: tuple[int, ...] = tuple(sorted(set(self.places.values()))) or (self.worker,)
        self.shards_left = len(self.shards)
        self.generated: dict[str, int] = {}  # partition -> tokens its worker says it sampled
        self.fed: dict[str, int] = {}  # partition -> text tokens taken into the answer
        # tokens its workers reported drawing that no emit brought here (audio codes a codec took)
        self.unseen_tokens = 0
        self.settled = asyncio.Event()  # every worker is done with it: `generated` is final
        # tokens the context surely holds: the worker's count at the last catch-up, plus pieces appended since
        # (a speech walk's sampled tokens are audio the event loop never counts)
        self.context_floor = 0
        self.between_turns = False  # it ran all its input and no piece came since: no turn is under way
        self.root_reason: str | None = None
        self.cut = False  # a worker's part of it ended "length" (a budget cut it), whatever the root's reason
        self.failed: str | None = None  # the error of a part that failed
        self.last_token: int | None = None  # the last token fed: the stop id that ended the text, if one did
        # the ids whose text the answer leaves out: a stop id's, the token that ends it, unless
        # `include_stop_str_in_output` (vLLM's); the same for each of its tokens, so worked out once
        self.hidden_ids = frozenset() if self.sampling.include_stop_str_in_output else self.stop_token_ids

    def worker_of(self, partition: str) -> int:
        return self.places.get(partition, self.worker)

    def awaiting(self, context_tokens: int) -> None:
        """The request has run all the input it was given; more may come.
        Its context holds `context_tokens` now: the floor of what it holds,
        which pieces appended later add to."""
        self.context_floor = max(self.context_floor, context_tokens)
        self.between_turns = True
        self.queue.put_nowait(OutputChunk(
            request_id=self.request_id, awaiting_input=True,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens))

    @property
    def _stops_armed(self) -> bool:
        """Its stop strings count: its tokens are past `min_tokens` (vLLM's)."""
        return self.num_output_tokens > self.sampling.min_tokens

    def feed_token(self, partition: str, token: int, text: str, logprob: list[float] | None = None) -> bool:
        """A new token from a step and its new text (detokenised by the
        caller), with the token's packed logprobs row when its step computed
        some; returns True when a stop string matched (the caller then stops
        the partition on its worker). Runs for every running request's token."""
        self.num_output_tokens += 1
        self.last_token = token
        fed = self.fed
        fed[partition] = fed.get(partition, 0) + 1
        if self.stops.stops:
            text, hit = self.stops.push(text, self._stops_armed)
        else:
            hit = False
        logprobs = None
        if logprob is not None and self.sampling.logprobs is not None:  # its step computed some, and it asked
            logprobs = (_token_logprob(token, logprob, self.sampling.logprobs),)
        self.queue.put_nowait(OutputChunk(
            request_id=self.request_id, token_ids=(token,), text=text, logprobs=logprobs,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens))
        if hit:
            self.stopped.add(partition)
            self.stop_reason = "stop"
        return hit

    def feed_run(self, partition: str, tokens: list[int], text: str) -> None:
        """Several tokens of one launch and their new text, as one chunk: for
        a request with no stop strings to look for between them (the caller
        feeds such a request's tokens one at a time)."""
        self.num_output_tokens += len(tokens)
        self.last_token = tokens[-1]
        fed = self.fed
        fed[partition] = fed.get(partition, 0) + len(tokens)
        self.queue.put_nowait(OutputChunk(
            request_id=self.request_id, token_ids=tuple(tokens), text=text,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens))

    def feed_value(self, partition: str, value: str, modality: str, data: object,
                   sample_rate: int | None = None) -> bool:
        """A non-token value: audio as PCM16 bytes, anything else as host data."""
        self.queue.put_nowait(OutputChunk(
            request_id=self.request_id, modality=modality,
            audio=data if isinstance(data, bytes) else None,
            sample_rate=sample_rate if isinstance(data, bytes) else None,
            data=None if isinstance(data, bytes) else data,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens))
        return False

    def host_stop(self, partition: str, value: str, data: object) -> bool:
        """Whether the walk's host stop predicate for this value says stop."""
        pred = self.host_predicates.get((partition, value))
        if pred is None or not pred(data):
            return False
        self.stopped.add(partition)
        self.stop_reason = "stop"
        return True

    @property
    def num_generated(self) -> int:
        """The tokens the request's answer cost: a stopped partition's text
        tokens up to the one that stopped it (a worker may have drawn more
        before the stop reached it, and its count of a row a stop took out
        of a decode group is the one it last had), every other partition's
        tokens as its worker counted them (a speech walk's sampled tokens
        are audio the event loop never counts)."""
        parts = self.generated.keys() | self.fed.keys()
        return sum(self.fed[p] if p in self.stopped and p in self.fed
                   else max(self.fed.get(p, 0), self.generated.get(p, 0)) for p in parts)

    @property
    def num_counted(self) -> int:
        """Its tokens the metrics counted as they came: the text tokens taken
        in, and those its workers reported drawing that reach no client as
        tokens. `num_generated` at its end counts them all (a stopped
        partition's text tokens as taken in, every other partition's as its
        worker sampled them), so its end adds what is left."""
        return sum(self.fed.values()) + self.unseen_tokens

    def shard_done(self, reason: str, error: str | None, generated: dict[str, int], worker: int) -> str | None:
        """Worker `worker` is done with its part of the request, which ended
        `reason` (`error`) with its partitions having sampled `generated`
        tokens. The request's final reason once every worker is done, else None."""
        self.shards_left -= 1
        for p, n in generated.items():
            self.generated[p] = self.generated.get(p, 0) + n
        if worker == self.worker:  # the root's worker: its last partition ends the way the root did
            self.root_reason = reason
        self.cut = self.cut or reason == "length"
        if reason == "error" and not self.finished:  # one part failed: so does the request, whenever
            self.failed = self.failed or error or "a part of the request failed"
        if self.shards_left > 0:
            return None
        self.settled.set()
        # a walk that emits audio, not tokens, still reports what it sampled
        self.num_output_tokens = max(self.num_output_tokens, self.num_generated)
        ended = self.root_reason if len(self.shards) > 1 and self.root_reason else reason
        ended = "length" if ended == "stop" and self.cut else ended  # a spoken answer's frames cut on another worker
        if self.stop_reason == "stop" and self.cut and not self.failed and not self._stopped_at_budget():
            # a stop string ended the text before its budget, so the budget that cut was another loop's (a spoken
            # answer's frames): the answer was cut short, as when a stop id ends its text
            return "length"
        return self.stop_reason or ("error" if self.failed else ended)

    def _stopped_at_budget(self) -> bool:
        """Whether a partition the event loop stopped reached its whole
        `max_tokens` too (its worker may have drawn on before the stop came):
        then its own budget may be the "length" a worker reported, and the
        stop wins, as vLLM checks stops before length."""
        budget = self.sampling.max_tokens
        return budget is not None and any(max(self.fed.get(p, 0), self.generated.get(p, 0)) >= budget
                                          for p in self.stopped)

    def finish(self, reason: FinishReason, error: str | None = None) -> FinishReason:
        """Close the stream with `reason`; returns the reason it ended with:
        "stop" where the text held back until now completes a stop string."""
        if self.finished:
            return reason
        self.finished = True
        tail = ""
        if self.stop_reason is None and reason in ("stop", "length"):
            # text held back (a partial character, a possible stop string) is final now
            rest = self.detok.flush() if self.detok is not None else ""
            tail, hit = self.stops.push(rest, self._stops_armed)
            if hit:  # the answer is cut at a stop string, so it ends as one (vLLM checks stops before length)
                self.stop_reason = reason = "stop"
            else:
                tail += self.stops.flush()
        self.queue.put_nowait(OutputChunk(
            request_id=self.request_id, text=tail, finished=True, finish_reason=reason, error=error,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens,
            stop_reason=self._stopped_by() if reason == "stop" else None))
        return reason

    def _stopped_by(self) -> int | str | None:
        """What ended an answer that stopped (vLLM's `stop_reason`): its stop
        string, else the `stop_token_ids` id it ended on; None for EOS (also
        when `stop_token_ids` names it: vLLM checks EOS first) or a walk's
        own stop."""
        if self.stops.matched is not None:
            return self.stops.matched
        last = self.last_token
        if last is None or last in self.eos_ids:
            return None
        return last if last in self.sampling.stop_token_ids else None


def _token_logprob(token: int, row: list[float], k: int) -> TokenLogprob:
    """A packed logprobs row (see `sampler.py`) as the `k` its request asked for."""
    width = (len(row) - 1) // 2
    values, ids = row[1:1 + k], row[1 + width:1 + width + k]
    return TokenLogprob(token, row[0], tuple(zip(map(int, ids), values)))


class RequestStream:
    """What `Engine.submit` returns: an async iterator of the request's chunks."""

    def __init__(self, state: RequestState, abort: Callable[[str], None]) -> None:
        self.request_id = state.request_id
        self.num_prompt_tokens = state.num_prompt_tokens
        self._state = state
        self._abort = abort
        self._done = False

    @property
    def num_generated(self) -> int | None:
        """Tokens the workers sampled for the request, once each is done with
        it (after an abort, a step after the last chunk); None before."""
        return self._state.num_generated if self._state.shards_left == 0 else None

    async def settled(self, timeout: float) -> int | None:
        """`num_generated` once every worker is done with the request (after
        an abort, within a step), or None if they are not within `timeout`
        seconds."""
        try:
            await asyncio.wait_for(self._state.settled.wait(), timeout)
        except TimeoutError:
            return None
        return self.num_generated

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[OutputChunk]:
        queue = self._state.queue
        try:
            while not self._done:
                chunk = await queue.get()
                if chunk.finished:
                    self._done = True
                yield chunk
        finally:
            if not self._done:
                self._abort(self.request_id)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)
