"""A walk in, its plan out: `compile_walk` checks a walk against the model's
components and the signatures of their modes (`WalkError` names the walk and
the node at fault), and turns it into a `WalkPlan`: the partitions that
advance on their own, the values each step reads and writes, which values
feed streams and which reach the client."""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.errors import WalkError
from mstar.graph.chunks import ChunkPolicy
from mstar.graph.nodes import Emit, FanOut, Loop, Node, Step, Stream, Walk
from mstar.graph.signatures import ACCEPTS, BUILTINS, Component, In, Kind, Mode, Out


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


class BindingError(ValueError):
    """A step binds values its mode's signature does not have."""


def step_bindings(step: Step, sig: Mode) -> tuple[dict[str, str], dict[str, str]]:
    """The step's bindings against `sig`: (signature input name -> walk value
    read, signature output name -> walk value written), whether the step binds
    by name or by position. Raises `BindingError` for a name the mode does not
    have, or more values than it takes."""
    return (_bind("input", sig.inputs, step.inputs, step.input_names),
            _bind("output", sig.outputs, step.outputs, step.output_names))


def _bind(what: str, declared: tuple[In, ...] | tuple[Out, ...], values: tuple[str, ...],
          names: tuple[str, ...] | None) -> dict[str, str]:
    have = [d.name for d in declared]
    if names is None:
        if len(values) > len(have):
            raise BindingError(f"binds {len(values)} {what}s by position; the mode has {have}")
        return dict(zip(have, values))
    unknown = [n for n in names if n not in have]
    if unknown:
        raise BindingError(f"binds {what}s {unknown} the mode does not have; it has {have}")
    return dict(zip(names, values))


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
        self.kinds: dict[str, Kind] = {}  # what the steps' signatures say each value is (walk inputs: unsaid)

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

    def _check_step(self, step: Step, available: set[str], where: str, *, in_loop: bool = False,
                    stream_source: str | None = None) -> None:
        comp = self.components.get(step.component)
        if comp is None:
            raise self.fail(where, f"unknown component '{step.component}'")
        if step.mode not in comp.modes:
            raise self.fail(where, f"component '{step.component}' has no mode '{step.mode}'")
        for value in step.inputs:
            if value in BUILTINS:
                if value == "@i" and not in_loop:
                    raise self.fail(where, "reads '@i' (the loop's iteration) outside a loop")
                if value == "@chunk" and stream_source is None:
                    raise self.fail(where, "reads '@chunk' (the stream chunk's index) outside a stream consumer")
            elif value.startswith("@"):
                raise self.fail(where, f"reads '{value}', which is no built-in value ({sorted(BUILTINS)})")
            elif value not in available:
                raise self.fail(where, f"reads '{value}', which nothing writes before it")
        sig = comp.signature(step.mode)
        if sig is None:
            if step.input_names is not None or step.output_names is not None:
                raise self.fail(where, f"binds values by name, but mode '{step.mode}' declares no signature")
            if not step.outputs:
                raise self.fail(where, "writes nothing")
            return
        try:
            reads, writes = step_bindings(step, sig)
        except BindingError as e:
            raise self.fail(where, str(e)) from None
        missing = [i.name for i in sig.inputs if not i.optional and i.name not in reads]
        if missing:
            raise self.fail(where, f"leaves the inputs {missing} of mode '{step.mode}' unbound")
        for name, value in reads.items():
            want = sig.input(name).kind
            got = BUILTINS.get(value) or (None if value == stream_source else self.kinds.get(value))
            if got is not None and got not in ACCEPTS[want]:
                raise self.fail(where, f"reads '{value}' ({got.value}) as '{name}', which takes "
                                       f"{want.value}")
        if not writes and sig.kv != "append":
            raise self.fail(where, "writes nothing")
        for name, value in writes.items():
            self.kinds[value] = sig.output(name).kind

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
                self._check_step(node.step, available, where, in_loop=True)
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
                self._check_step(node.into, available | {node.source}, f"{where} -> {node.into.label}",
                                 stream_source=node.source)
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
