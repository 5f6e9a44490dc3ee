"""The graph layer: components, modes, walks, and the plan a walk compiles to.

A model declares `Component`s and `Walk`s built from `Step`, `Loop`, `Stream`,
`FanOut` and `Emit`. `compile_walk` validates a walk against the components and
turns it into a `WalkPlan`: the partitions that advance independently, the
values each step reads and writes, which values feed streams and which reach
the client. This module is a leaf: it imports neither torch nor the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from mstar.errors import WalkError


@dataclass(frozen=True)
class Component:
    """A model part with weights and one batched entry point per mode.

    `kv_cache`: the component keeps a paged KV cache per row; its modes take
    token ids and append them to the row's cache. `samples`: its modes return
    logits that the runtime samples into one token per row.
    """

    modes: tuple[str, ...]
    kv_cache: bool = False
    samples: bool = False


# ---------------------------------------------------------------- stop rules


class StopRule:
    """When a loop stops. Checked each time the loop's value is written,
    including the write that enters the loop."""

    def __or__(self, other: StopRule) -> AnyOf:
        return AnyOf(self.rules() + other.rules())

    def rules(self) -> tuple[StopRule, ...]:
        return (self,)


@dataclass(frozen=True)
class EosToken(StopRule):
    """The model's EOS ids plus the request's `stop_token_ids`, unless the
    request sets `ignore_eos` (request stop ids still apply then)."""


@dataclass(frozen=True)
class TokenIn(StopRule):
    """Fixed token ids that end the loop (ignored under `ignore_eos`)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class MaxTokens(StopRule):
    """The request's `max_tokens`: counts the writes of the loop value."""


@dataclass(frozen=True)
class MaxSteps(StopRule):
    """A fixed cap on the writes of the loop value."""

    n: int


@dataclass(frozen=True)
class HostStop(StopRule):
    """The event loop decides (stop strings, or `predicate` over each emitted
    host value). It arrives late: the worker may have launched more steps."""

    predicate: Callable[[object], bool] | None = None


@dataclass(frozen=True)
class AnyOf(StopRule):
    parts: tuple[StopRule, ...]

    def rules(self) -> tuple[StopRule, ...]:
        return self.parts

    def find(self, kind: type) -> StopRule | None:
        return next((r for r in self.parts if isinstance(r, kind)), None)


# ----------------------------------------------------------- chunk policies


class ChunkPolicy:
    """Cuts a growing sequence of stream items into chunks for the consumer."""

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        """Chunks [start, end) that can be cut now. `total`: items produced so
        far; `cut`: the number of chunks already cut."""
        raise NotImplementedError

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        """Chunks to cut when the producer has finished."""
        raise NotImplementedError

    def keep_from(self, total: int, cut: int) -> int:
        """Items before this index are never read again (they may be freed)."""
        raise NotImplementedError


@dataclass(frozen=True)
class SlidingWindow(ChunkPolicy):
    """Windows of `size` items every `stride` items: window i is
    [i*stride, i*stride + size). At the end, if items are left that no window
    covered, the window that would have come next is cut short at the end of
    the stream, [cut*stride, total): a consumer knows it is the last by its
    length (the whole stream, when it is shorter than one window)."""

    size: int
    stride: int

    def __post_init__(self) -> None:
        if self.size <= 0 or self.stride <= 0 or self.stride > self.size:
            raise ValueError("SlidingWindow needs 0 < stride <= size")

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        out = []
        i = cut
        while i * self.stride + self.size <= total:
            out.append((i * self.stride, i * self.stride + self.size))
            i += 1
        return out

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        covered = 0 if cut == 0 else (cut - 1) * self.stride + self.size
        if total <= covered:
            return []
        return [(cut * self.stride, total)]

    def keep_from(self, total: int, cut: int) -> int:
        return cut * self.stride


@dataclass(frozen=True)
class FixedChunks(ChunkPolicy):
    """Consecutive chunks of `size` items; the last one may be shorter."""

    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError("FixedChunks needs size > 0")

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        return [(i * self.size, (i + 1) * self.size) for i in range(cut, total // self.size)]

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        start = cut * self.size
        return [(start, total)] if total > start else []

    def keep_from(self, total: int, cut: int) -> int:
        return cut * self.size


# ------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Step:
    """One batched call of `component.mode` reading and writing named values."""

    component: str
    mode: str
    reads: str | tuple[str, ...]
    writes: str | tuple[str, ...]

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.reads,) if isinstance(self.reads, str) else tuple(self.reads)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.writes,) if isinstance(self.writes, str) else tuple(self.writes)

    @property
    def label(self) -> str:
        return f"{self.component}.{self.mode}"


@dataclass(frozen=True)
class Loop:
    """Repeat `step` until `until` holds; its first output loops back as its
    first input, on the device."""

    step: Step
    until: StopRule | None

    @property
    def value(self) -> str:
        return self.step.outputs[0]


@dataclass(frozen=True)
class Stream:
    """Items written by a producer loop flow, in chunks, into `into`, which
    runs concurrently as its own partition (named `partition` or after the
    consumer's component). With `accept`, only integer items in that id range
    enter (a speech LM's audio tokens, not its control tokens)."""

    source: str
    into: Step | None
    chunks: ChunkPolicy
    partition: str | None = None
    accept: tuple[int, int] | None = None  # only integer items in [lo, hi) enter the stream


@dataclass(frozen=True)
class Emit:
    """A value that reaches the client each time it is written."""

    value: str
    modality: str = "text"
    sample_rate: int | None = None


Node = Union[Step, Loop, Stream, Emit, "FanOut"]


@dataclass(frozen=True)
class FanOut:
    """Branches that start together, each as its own partition, reading the
    values written before them; the parent partition goes on concurrently."""

    branches: tuple[tuple[Node, ...], ...]
    names: tuple[str, ...] = ()


class Walk:
    """A named plan for a request: `Walk(*nodes, inputs=(...))`.

    `more_input`: an input that may keep arriving while the request runs (text
    streamed into a speech request). Each new piece is one more turn of the
    root partition: when its loop ends, the partition starts over at its first
    step with the piece as that input, on the same KV cache, and its streams
    start a new segment. The root's first node must be a step reading it."""

    def __init__(self, *nodes: Node, inputs: tuple[str, ...], partition: str | None = None,
                 more_input: str | None = None) -> None:
        self.nodes = tuple(nodes)
        self.inputs = tuple(inputs)
        self.partition = partition
        self.more_input = more_input


# -------------------------------------------------------------------- plan


@dataclass(frozen=True)
class StreamPlan:
    """A stream edge: `source` written by `producer`'s loop feeds `consumer`."""

    source: str
    producer: str
    consumer: str
    chunks: ChunkPolicy
    accept: tuple[int, int] | None = None


@dataclass(frozen=True)
class PartitionPlan:
    """A sequence of steps and loops that advances on its own.

    A stream consumer has `stream` set: it runs its single step once per chunk.
    A fan-out branch has `parent` set: it starts after node `start_after` of
    the parent completes.
    """

    name: str
    nodes: tuple[Step | Loop, ...]
    stream: StreamPlan | None = None
    parent: str | None = None
    start_after: int = -1


@dataclass(frozen=True)
class WalkPlan:
    name: str
    inputs: tuple[str, ...]
    partitions: dict[str, PartitionPlan]
    root: str
    emits: dict[str, Emit]
    streams: dict[str, tuple[StreamPlan, ...]] = field(default_factory=dict)
    forks: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    more_input: str | None = None

    def components(self) -> set[str]:
        return {(n.step if isinstance(n, Loop) else n).component
                for p in self.partitions.values() for n in p.nodes}


def compile_walk(name: str, walk: Walk, components: dict[str, Component]) -> WalkPlan:
    """Validate `walk` and compile it; raises `WalkError` naming the step."""
    builder = _Builder(name, walk, components)
    return builder.build()


def compile_walks(walks: dict[str, Walk], components: dict[str, Component]) -> dict[str, WalkPlan]:
    return {name: compile_walk(name, w, components) for name, w in walks.items()}


class _Builder:
    def __init__(self, name: str, walk: Walk, components: dict[str, Component]) -> None:
        self.name = name
        self.walk = walk
        self.components = components
        self.partitions: dict[str, PartitionPlan] = {}
        self.emits: dict[str, Emit] = {}
        self.streams: dict[str, list[StreamPlan]] = {}
        self.forks: dict[tuple[str, int], tuple[str, ...]] = {}
        self.written: set[str] = set(walk.inputs)

    def fail(self, where: str, reason: str) -> WalkError:
        return WalkError(self.name, where, reason)

    def build(self) -> WalkPlan:
        if not self.walk.nodes:
            raise self.fail("-", "the walk has no steps")
        root = self.walk.partition or self._first_component(self.walk.nodes) or "main"
        self._partition(root, self.walk.nodes, available=set(self.walk.inputs), parent=None, start_after=-1)
        for value, emit in self.emits.items():
            if value not in self.written:
                raise self.fail(f"emit {value}", f"emits '{value}', which no step writes")
        self._check_more_input(root)
        return WalkPlan(
            name=self.name,
            inputs=self.walk.inputs,
            partitions=self.partitions,
            root=root,
            emits=self.emits,
            streams={k: tuple(v) for k, v in self.streams.items()},
            forks=self.forks,
            more_input=self.walk.more_input,
        )

    def _check_more_input(self, root: str) -> None:
        more = self.walk.more_input
        if more is None:
            return
        first = self.partitions[root].nodes[0]
        if more not in self.walk.inputs:
            raise self.fail(f"more_input {more}", f"'{more}' is not an input of the walk")
        if not isinstance(first, Step) or more not in first.inputs:
            raise self.fail(f"more_input {more}", "the root partition's first node must be a step reading it")
        if not any(isinstance(n, Loop) for n in self.partitions[root].nodes):
            raise self.fail(f"more_input {more}", "the root partition has no loop to end a turn")

    def _first_component(self, nodes: tuple[Node, ...]) -> str | None:
        for n in nodes:
            if isinstance(n, Step):
                return n.component
            if isinstance(n, Loop):
                return n.step.component
        return None

    def _check_step(self, step: Step, available: set[str], where: str) -> None:
        comp = self.components.get(step.component)
        if comp is None:
            raise self.fail(where, f"unknown component '{step.component}'")
        if step.mode not in comp.modes:
            raise self.fail(where, f"component '{step.component}' has no mode '{step.mode}'")
        for value in step.inputs:
            if value not in available:
                raise self.fail(where, f"reads '{value}', which nothing writes before it")
        if not step.outputs:
            raise self.fail(where, "writes nothing")

    def _partition(self, pname: str, nodes: tuple[Node, ...], available: set[str],
                   parent: str | None, start_after: int) -> None:
        if pname in self.partitions:
            raise self.fail(pname, f"partition '{pname}' is declared twice")
        seq: list[Step | Loop] = []
        loop_values: dict[str, Loop] = {}
        self.partitions[pname] = PartitionPlan(pname, (), parent=parent, start_after=start_after)
        for node in nodes:
            if isinstance(node, Step):
                self._check_step(node, available, node.label)
                seq.append(node)
                available |= set(node.outputs)
            elif isinstance(node, Loop):
                where = f"loop {node.step.label}"
                if node.until is None:
                    raise self.fail(where, "the loop has no stop rule")
                self._check_step(node.step, available, where)
                if node.value not in node.step.inputs and node.value not in available:
                    raise self.fail(where, f"its output '{node.value}' is not an input it can loop back into")
                seq.append(node)
                available |= set(node.step.outputs)
                loop_values[node.value] = node
            elif isinstance(node, Stream):
                where = f"stream {node.source}"
                if node.into is None:
                    raise self.fail(where, "the stream has no consumer")
                if node.source not in loop_values:
                    raise self.fail(where, f"'{node.source}' is not written by a loop before the stream")
                consumer = node.partition or node.into.component
                self._check_step(node.into, available | {node.source}, f"{where} -> {node.into.label}")
                plan = StreamPlan(node.source, pname, consumer, node.chunks, node.accept)
                self.streams.setdefault(node.source, []).append(plan)
                if consumer in self.partitions:
                    raise self.fail(where, f"partition '{consumer}' is declared twice")
                self.partitions[consumer] = PartitionPlan(consumer, (node.into,), stream=plan)
                self.written |= set(node.into.outputs)
            elif isinstance(node, Emit):
                self.emits[node.value] = node
            elif isinstance(node, FanOut):
                names = node.names or tuple(
                    self._first_component(b) or f"{pname}.{i}" for i, b in enumerate(node.branches))
                if len(names) != len(node.branches):
                    raise self.fail(f"fanout in {pname}", "names and branches differ in number")
                for bname, branch in zip(names, node.branches):
                    self._partition(bname, branch, set(available), parent=pname, start_after=len(seq) - 1)
                self.forks[(pname, len(seq) - 1)] = tuple(names)
            else:
                raise self.fail(repr(node), "is not a walk node")
        self.written |= available
        self.partitions[pname] = PartitionPlan(pname, tuple(seq), parent=parent, start_after=start_after)
        if not seq:
            raise self.fail(pname, "the partition has no steps")
