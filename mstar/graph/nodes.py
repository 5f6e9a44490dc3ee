"""The nodes a walk is built from: `Step` (one batched call of a component's
mode), `Loop` (and what it may `Collect`), `Stream` (a producer's writes into
a concurrent consumer, a `Partition` of its own), `Emit` (a value to the
client), `FanOut`, and `Walk` itself. Plain
declarations: `compile.py` checks them and turns them into a plan."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Union

from mstar.graph.chunks import ChunkPolicy
from mstar.graph.stops import StopRule


# How a step binds walk values: by position (a name, or a tuple of names), or
# by the mode's signature names, `{"ids": "prompt_ids"}` (kept as pairs, so a
# step stays hashable).
Binding = Union[str, tuple[str, ...], Mapping[str, str], tuple[tuple[str, str], ...]]


def _pairs(binding: Binding) -> Binding:
    return tuple(binding.items()) if isinstance(binding, Mapping) else binding


def _values(binding: Binding) -> tuple[str, ...]:
    if isinstance(binding, str):
        return (binding,)
    return tuple(b[1] if isinstance(b, tuple) else b for b in binding)


def _names(binding: Binding) -> tuple[str, ...] | None:
    if isinstance(binding, str) or not binding or not isinstance(binding[0], tuple):
        return None
    return tuple(b[0] for b in binding)


@dataclass(frozen=True)
class Step:
    """One batched call of `component.mode` reading and writing named values.

    `reads` / `writes` bind walk values by position, or by the names of the
    mode's signature (`graph/signatures.py`) as a mapping. `sampling`: the
    sampling key its token draws under (its own params, seed and overrides,
    such as a code predictor's inside a talker's partition); by default the
    partition's. `draws`: the sampling key of the tokens a mode declared with
    `draws` samples itself (a code predictor's, run inside a talker's frame
    mode)."""

    component: str
    mode: str
    reads: Binding
    writes: Binding
    sampling: str | None = None
    draws: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", _pairs(self.reads))
        object.__setattr__(self, "writes", _pairs(self.writes))

    @functools.cached_property  # a step is immutable; the runtime asks per row and step
    def inputs(self) -> tuple[str, ...]:
        """The walk values read, in binding order."""
        return _values(self.reads)

    @functools.cached_property  # a step is immutable; the runtime asks per row and step
    def outputs(self) -> tuple[str, ...]:
        """The walk values written, in binding order."""
        return _values(self.writes)

    @functools.cached_property  # a step is immutable; the runtime asks per row and step
    def input_names(self) -> tuple[str, ...] | None:
        """The signature names the inputs bind to; None when bound by position."""
        return _names(self.reads)

    @functools.cached_property  # a step is immutable; the runtime asks per row and step
    def output_names(self) -> tuple[str, ...] | None:
        return _names(self.writes)

    @property
    def label(self) -> str:
        return f"{self.component}.{self.mode}"


@dataclass(frozen=True)
class Collect:
    """What a loop gathers: each write of `each` while the loop runs (the
    write that enters it included), after the values of `first`, stacked
    into `into` when the loop ends."""

    into: str
    each: str
    first: tuple[str, ...] = ()


@dataclass(frozen=True, init=False)
class Loop:
    """Repeat `body` (a step, or a sequence of steps and nested loops) until
    `until` holds. The rule is checked each time `value` is written (by
    default the first output of the body's first step), the write by the step
    just before the loop included: that write enters the loop. `step=` is
    the one-step form's other spelling."""

    body: tuple[Step | Loop | Each, ...]
    until: StopRule | None
    value: str
    collect: Collect | None

    def __init__(self, body: Step | Loop | Each | tuple[Step | Loop | Each, ...] | None = None,
                 until: StopRule | None = None,
                 value: str | None = None, collect: Collect | None = None, *, step: Step | None = None) -> None:
        if (body is None) == (step is None):
            raise ValueError("a loop takes its body, or its one step as step=")
        body = body if body is not None else step
        body = tuple(body) if isinstance(body, tuple) else (body,)
        first = _first_step(body)
        if value is None and (first is None or not first.outputs):
            raise ValueError("a loop whose first step writes nothing names its value")
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "until", until)
        object.__setattr__(self, "value", value if value is not None else first.outputs[0])
        object.__setattr__(self, "collect", collect)

    @property
    def step(self) -> Step:
        """The body's first step (a one-step loop's only step)."""
        first = _first_step(self.body)
        assert first is not None
        return first

    @functools.cached_property  # read at every request's loop start; a walk's nodes never change
    def writer(self) -> Step | None:
        """The step directly in its body that writes its value (None: a
        nested loop's or an `Each`'s does)."""
        return next((s for s in self.body if isinstance(s, Step) and self.value in s.outputs), None)


def _first_step(body: tuple) -> Step | None:
    for node in body:
        if isinstance(node, Step):
            return node
        if isinstance(node, Loop):
            return _first_step(node.body)
        if isinstance(node, Each) and node.steps:
            return node.steps[0]
    return None


@dataclass(frozen=True, init=False)
class Partition:
    """A sub-walk of its own, `Partition(name, *nodes)`: the consumer of a
    stream that prefills, loops with its own KV cache and streams on, beside
    its producer."""

    name: str
    nodes: tuple[Node, ...]

    def __init__(self, name: str, *nodes: Node) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "nodes", tuple(nodes))


@dataclass(frozen=True)
class Stream:
    """Each write of `source` by its partition is an item that flows, in
    chunks (`chunks`), into `into`, which runs concurrently as a partition of
    its own: a `Partition`, or one `Step` run once per chunk (a partition
    named `partition` or after the step's component). The consumer reads the
    stream as the value `as_` (default: `source`) and starts at the first
    item, with the values it reads that its producer had written by then.
    With `accept`, only integer items in that id range enter (a speech LM's
    audio tokens, not its control tokens). When the producer ends a turn (a
    walk taking more input), `on_turn="segment"` cuts the stream's tail and
    counts chunks anew; `"restart"` also ends the consumer's pass: it skips
    what is left of the turn and starts over at its first node at the next
    turn's first item, with that turn's values (its KV cache kept)."""

    source: str
    into: Step | Partition | None
    chunks: ChunkPolicy
    partition: str | None = None
    accept: tuple[int, int] | None = None  # only integer items in [lo, hi) enter the stream
    as_: str | None = None
    on_turn: Literal["segment", "restart"] = "segment"


@dataclass(frozen=True)
class Emit:
    """A value that reaches the client each time it is written."""

    value: str
    modality: str = "text"
    sample_rate: int | None = None


@dataclass(frozen=True, init=False)
class Fork:
    """The partition's KV row of `component` becomes several: the row it has
    is branch "main", and each named branch starts with what main has cached
    ("share": main's full pages shared, its last partial page copied) or with
    an empty cache ("fresh"). `component` may be left out when the partition
    has stepped one KV component. Classifier-free guidance forks a prompt's
    cache into the contexts it compares."""

    branches: tuple[tuple[str, str], ...]
    component: str | None

    def __init__(self, *branches: tuple[str, str], component: str | None = None) -> None:
        object.__setattr__(self, "branches", tuple(branches))
        object.__setattr__(self, "component", component)

    @property
    def names(self) -> tuple[str, ...]:
        """Every branch, "main" first."""
        return ("main", *(name for name, _ in self.branches))


@dataclass(frozen=True, init=False)
class Each:
    """Steps that run once per branch of the partition's `Fork` (or on the
    `only` ones), the branches' rows batched in one step; what they write is
    per branch. A step after it that reads such a value gets it stacked over
    the branches that wrote it, "main" first (the join)."""

    steps: tuple[Step, ...]
    only: tuple[str, ...] | None

    def __init__(self, *steps: Step, only: tuple[str, ...] | None = None) -> None:
        object.__setattr__(self, "steps", tuple(steps))
        object.__setattr__(self, "only", tuple(only) if only is not None else None)


Node = Union[Step, Loop, Stream, Emit, "FanOut", Fork, Each]  # and a Partition, as a stream's consumer


@dataclass(frozen=True)
class FanOut:
    """Branches that start together, each as its own partition, reading the
    values written before them; the parent partition goes on concurrently."""

    branches: tuple[tuple[Node, ...], ...]
    names: tuple[str, ...] = ()


class Walk:
    """A named plan for a request: `Walk(*nodes, inputs=(...))`.

    `more_input`: inputs that may keep arriving while the request runs (text
    streamed into a speech request; audio, with its ids and positions, into
    an omni one). Each new piece is one more turn of the root partition: when
    its top-level loop ends, the partition starts over at its first step with
    the piece as those inputs (joined to the turn before by the model's
    `join_turn`), on the same KV cache, and its streams start a new segment.
    The root's first node must be a step reading one of them."""

    def __init__(self, *nodes: Node, inputs: tuple[str, ...], partition: str | None = None,
                 more_input: str | tuple[str, ...] | None = None) -> None:
        self.nodes = tuple(nodes)
        self.inputs = tuple(inputs)
        self.partition = partition
        self.more_input = (more_input,) if isinstance(more_input, str) else more_input
