"""A walk in, its plan out: `compile_walk` checks a walk against the model's
components and the signatures of their modes (`WalkError` names the walk and
the node at fault), and turns it into a `WalkPlan`: the partitions that
advance on their own, the values each step reads and writes, which values
feed streams and which reach the client."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mstar.errors import WalkError
from mstar.graph.chunks import ChunkPolicy
from mstar.graph.branches import Branches
from mstar.graph.own_stream import own_stream_values
from mstar.graph.nodes import Each, Emit, FanOut, Fork, Loop, Node, Partition, Step, Stream, Walk
from mstar.graph.program import Instr, LoopPlan, ProgramBuilder, Run
from mstar.graph.signatures import ACCEPTS, BUILTINS, Component, In, Kind, Mode, Out
from mstar.graph.stops import HostStop, MaxSteps, StreamDone


@dataclass(frozen=True)
class StreamPlan:
    """A stream edge: `source` written by `producer` feeds `consumer`, which
    reads it as `as_`; `carries`: the producer's values the consumer reads,
    handed over when the first item starts it."""

    source: str
    producer: str
    consumer: str
    chunks: ChunkPolicy
    accept: tuple[int, int] | None = None
    as_: str = ""
    carries: tuple[str, ...] = ()
    on_turn: str = "segment"


@dataclass(frozen=True)
class PartitionPlan:
    """A sequence of steps and loops that advances on its own: `nodes` as
    declared, `program` as the worker runs them (`program.py`), with `loops`
    indexed by its instructions.

    A stream consumer has `stream` set: its steps that read `stream.as_` take
    the stream's next chunk each time they run. A fan-out branch has `parent` set: it starts when the parent's cursor
    reaches `starts_at`.
    """

    name: str
    nodes: tuple[Step | Loop, ...]
    stream: StreamPlan | None = None
    parent: str | None = None
    starts_at: int = 0
    program: tuple[Instr, ...] = ()
    loops: tuple[LoopPlan, ...] = ()

    @functools.cached_property  # read on every request's intake; the plan never changes
    def steps(self) -> tuple[Step, ...]:
        """Every step of the partition, nested ones included, in program order."""
        return tuple(i.step for i in self.program if isinstance(i, Run))


@dataclass(frozen=True)
class WalkPlan:
    name: str
    inputs: tuple[str, ...]
    partitions: dict[str, PartitionPlan]
    root: str
    emits: dict[str, Emit]
    streams: dict[str, tuple[StreamPlan, ...]] = field(default_factory=dict)
    forks: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    more_input: tuple[str, ...] | None = None   # the inputs a later turn brings (`Walk.more_input`)
    # the keys a request's sampling takes, the root's first: each partition with a step that samples under the
    # partition's key, each step's own key (`Step.sampling`), and the keys of tokens modes draw themselves
    sampling_keys: tuple[str, ...] = ()
    draw_keys: tuple[str, ...] = ()  # of those, the keys of in-mode draws (`Step.draws`)

    def components(self) -> set[str]:
        return {s.component for p in self.partitions.values() for s in p.steps}

    @functools.cached_property  # read by every request's intake; the plan never changes
    def host_predicates(self) -> Mapping[tuple[str, str], Callable[[object], bool]]:
        """(partition, loop value) -> the predicate of the loop's `HostStop`,
        which the event loop judges each of the loop's outputs by."""
        return MappingProxyType({(name, spec.loop.value): rule.predicate
                                 for name, part in self.partitions.items() for spec in part.loops
                                 if spec.loop.until is not None for rule in spec.loop.until.rules()
                                 if isinstance(rule, HostStop) and rule.predicate is not None})


class BindingError(ValueError):
    """A step binds values its mode's signature does not have."""


@functools.lru_cache(maxsize=4096)
def step_bindings(step: Step, sig: Mode) -> tuple[Mapping[str, str], Mapping[str, str]]:
    """The step's bindings against `sig`: (signature input name -> walk value
    read, signature output name -> walk value written), whether the step binds
    by name or by position. Raises `BindingError` for a name the mode does not
    have, or more values than it takes. Worked out once per (step, mode): the
    runtime asks for every row of every step, so the mappings are read-only."""
    return (MappingProxyType(_bind("input", sig.inputs, step.inputs, step.input_names)),
            MappingProxyType(_bind("output", sig.outputs, step.outputs, step.output_names)))


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


def samples(component: Component, mode: str) -> bool:
    """Whether steps of `mode` draw tokens: a sampling component's, or a mode declaring a TOKEN output."""
    sig = component.signature(mode)
    return component.samples or (sig is not None and any(o.kind is Kind.TOKEN for o in sig.outputs))


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
        self.collected: set[str] = set()  # values loops collect (the walker writes them, not a step)
        self._reading: str | None = None  # the stream value of the consumer partition being compiled
        self._branches = Branches(self.fail)  # of the partition being compiled
        self.branch_values: set[str] = set()  # values some Each writes per branch
        # values written by a component on a CUDA stream of its own -> it (no other component reads them)
        self.own_stream = own_stream_values(walk.nodes, components, self.fail)

    def fail(self, where: str, reason: str) -> WalkError:
        return WalkError(self.name, where, reason)

    def build(self) -> WalkPlan:
        if not self.walk.nodes:
            raise self.fail("-", "the walk has no steps")
        root = self.walk.partition or self._first_component(self.walk.nodes) or "main"
        self._partition(root, self.walk.nodes, available=set(self.walk.inputs), parent=None, starts_at=0)
        for value, emit in self.emits.items():
            if value not in self.written:
                raise self.fail(f"emit {value}", f"emits '{value}', which no step writes")
            if value in self.collected:
                raise self.fail(f"emit {value}", f"emits '{value}', which a loop collects: emit what the loop's "
                                                 f"steps write instead")
            if value in self.branch_values:
                raise self.fail(f"emit {value}", f"emits '{value}', which an Each writes per branch: emit what a "
                                                 f"step joining them writes instead")
        self._check_more_input(root)
        draws = tuple(step.draws for part in self.partitions.values() for step in part.steps
                      if step.draws is not None)
        sampling = [name for name, part in self.partitions.items()
                    if any(samples(self.components[step.component], step.mode) and step.sampling is None
                           for step in part.steps)]
        sampling += [step.sampling for part in self.partitions.values() for step in part.steps
                     if step.sampling is not None]
        return WalkPlan(
            name=self.name,
            inputs=self.walk.inputs,
            partitions=self.partitions,
            root=root,
            emits=self.emits,
            streams={k: tuple(v) for k, v in self.streams.items()},
            forks=self.forks,
            more_input=self.walk.more_input,
            sampling_keys=tuple(dict.fromkeys((root, *sampling, *draws))),
            draw_keys=draws,
        )

    def _check_more_input(self, root: str) -> None:
        more = self.walk.more_input
        if more is None:
            return
        where = f"more_input {', '.join(more)}"
        if not more:
            raise self.fail(where, "names no input")
        first = self.partitions[root].nodes[0]
        missing = [m for m in more if m not in self.walk.inputs]
        if missing:
            raise self.fail(where, f"{missing} are not inputs of the walk")
        if not isinstance(first, Step) or not set(more) & set(first.inputs):
            raise self.fail(where, "the root partition's first node must be a step reading one of them")
        if not any(isinstance(n, Loop) for n in self.partitions[root].nodes):
            raise self.fail(where, "the root partition has no loop to end a turn")

    def _first_component(self, nodes: tuple[Node, ...]) -> str | None:
        for n in nodes:
            if isinstance(n, Step):
                return n.component
            if isinstance(n, Loop):
                return n.step.component
        return None

    def _check_step(self, step: Step, available: set[str], where: str, *, in_loop: bool = False,
                    branches: tuple[str, ...] | None = None) -> None:
        comp = self.components.get(step.component)
        if comp is None:
            raise self.fail(where, f"unknown component '{step.component}'")
        if step.mode not in comp.modes:
            raise self.fail(where, f"component '{step.component}' has no mode '{step.mode}'")
        for value in step.inputs:
            if value in BUILTINS:
                if value == "@i" and not in_loop:
                    raise self.fail(where, "reads '@i' (the loop's iteration) outside a loop")
                if value == "@chunk" and (self._reading is None or self._reading not in step.inputs):
                    raise self.fail(where, "reads '@chunk' (the stream chunk's index) in a step that reads no "
                                           "stream")
            elif value.startswith("@"):
                raise self.fail(where, f"reads '{value}', which is no built-in value ({sorted(BUILTINS)})")
            elif value not in available:
                raise self.fail(where, f"reads '{value}', which nothing writes before it")
            elif self.own_stream.get(value, step.component) != step.component:
                raise self.fail(where, f"reads '{value}', which '{self.own_stream[value]}' writes on a CUDA "
                                       f"stream of its own (own_stream): only the client may read it")
        sig = comp.signature(step.mode)
        if (step.draws is not None) != bool(sig is not None and sig.draws):
            raise self.fail(where, f"names a key for in-mode draws, but mode '{step.mode}' declares none"
                            if step.draws is not None else
                            f"mode '{step.mode}' samples {sig.draws} tokens itself: name their key (draws=)")
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
            got = BUILTINS.get(value) or (None if value == self._reading else self.kinds.get(value))
            if got is not None and got not in ACCEPTS[want]:
                raise self.fail(where, f"reads '{value}' ({got.value}) as '{name}', which takes "
                                       f"{want.value}")
        if not writes and sig.kv != "append":
            raise self.fail(where, "writes nothing")
        if sig.reset and step.component == self._branches.forked:
            # its full pages are shared with the other branches: starting over would write into theirs
            raise self.fail(where, f"mode '{step.mode}' restarts the cache of '{step.component}', which the "
                                   "partition forked")
        for name, value in writes.items():
            self.kinds[value] = sig.output(name).kind
        self._branches.step(step, where, branches)

    def _partition(self, pname: str, nodes: tuple[Node, ...], available: set[str],
                   parent: str | None, starts_at: int, stream: StreamPlan | None = None) -> None:
        if pname in self.partitions:
            raise self.fail(pname, f"partition '{pname}' is declared twice")
        seq: list[Step | Loop] = []
        written: dict[str, set[str]] = {}  # value -> what is available once the partition first wrote it
        program = ProgramBuilder()
        outer, self._branches = self._branches, Branches(self.fail)
        prev: int | None = None  # the Run a loop right after it may be entered by
        self.partitions[pname] = PartitionPlan(pname, (), stream=stream, parent=parent, starts_at=starts_at)
        for node in nodes:
            if isinstance(node, Step):
                self._check_step(node, available, node.label)
                seq.append(node)
                available |= set(node.outputs)
                _first_writes(written, node.outputs, available)
                prev = program.add(node, prev)
            elif isinstance(node, Loop):
                entering = program.program[prev].step if prev is not None else None
                self._check_loop(node, available, f"loop {node.step.label}", (), entering, written)
                seq.append(node)
                program.add(node, prev)
                prev = None
            elif isinstance(node, Stream):
                self._stream(node, pname, written)
            elif isinstance(node, Emit):
                self.emits[node.value] = node
            elif isinstance(node, FanOut):
                names = node.names or tuple(
                    self._first_component(b) or f"{pname}.{i}" for i, b in enumerate(node.branches))
                if len(names) != len(node.branches):
                    raise self.fail(f"fanout in {pname}", "names and branches differ in number")
                for bname, branch in zip(names, node.branches):
                    self._partition(bname, branch, set(available), parent=pname, starts_at=len(program))
                self.forks[(pname, len(program))] = tuple(names)
            elif isinstance(node, Fork):
                where = f"fork in {pname}"
                if self.walk.more_input and parent is None and stream is None:
                    raise self.fail(where, "a partition taking turns of more input cannot fork")
                steps = [i.step for i in program.program if isinstance(i, Run)]
                kv = [c for c in dict.fromkeys(s.component for s in steps) if self.components[c].kv_cache]
                if any(self.components[c].state for c in kv):
                    # a branch would need a copy of the row's state slot, which nothing makes
                    raise self.fail(where, "cannot fork a partition that steps a component with per-row state")
                program.fork(node, self._branches.fork(node, kv, where))
                prev = None
            elif isinstance(node, Each):
                self._each(node, available, f"each in {pname}", (), in_loop=False)
                program.add(node, prev)
                prev = None
            else:
                raise self.fail(repr(node), "is not a walk node")
        self.written |= available
        self.branch_values |= self._branches.ever
        self._branches = outer
        self.partitions[pname] = PartitionPlan(pname, tuple(seq), stream=stream, parent=parent, starts_at=starts_at,
                                               program=program.finish(), loops=tuple(program.loops))
        if not seq:
            raise self.fail(pname, "the partition has no steps")

    def _each(self, each: Each, available: set[str], where: str, around: tuple[Loop, ...], in_loop: bool) -> None:
        branches = self._branches.each(each, where)
        for step in each.steps:
            label = f"{where}/{step.label}"
            self._check_step(step, available, label, in_loop=in_loop, branches=branches)
            ours = [o.value for o in around if o.value in step.outputs]
            if ours:
                raise self.fail(label, f"writes '{ours[0]}', a loop's value, per branch; a step joining the "
                                       f"branches writes it")
            available |= set(step.outputs)

    def _stream(self, node: Stream, pname: str, written: dict[str, set[str]]) -> None:
        where = f"stream {node.source}"
        if node.into is None:
            raise self.fail(where, "the stream has no consumer")
        if node.source not in written:
            raise self.fail(where, f"'{node.source}' is not written by a step of '{pname}' before the stream")
        as_ = node.as_ or node.source
        if isinstance(node.into, Partition):
            consumer, nodes = node.into.name, node.into.nodes
        else:  # one step per chunk, for as long as the stream runs
            consumer = node.partition or node.into.component
            if not node.into.outputs:
                raise self.fail(f"{where} -> {node.into.label}", "writes nothing")
            nodes = (Loop(node.into, until=StreamDone()),)
        if consumer in self.partitions:
            raise self.fail(where, f"partition '{consumer}' is declared twice")
        reads = _reads(nodes)
        if as_ not in reads:
            raise self.fail(where, f"flows into '{consumer}' as '{as_}', which none of its steps reads")
        offered = written[node.source] - {node.source}  # what the producer has written by its first item
        if node.on_turn not in ("segment", "restart"):
            raise self.fail(where, f"on_turn is 'segment' or 'restart', not {node.on_turn!r}")
        if node.source in self.own_stream:
            raise self.fail(where, f"streams '{node.source}', which '{self.own_stream[node.source]}' writes on a "
                                   f"CUDA stream of its own (own_stream): only the client may read it")
        plan = StreamPlan(node.source, pname, consumer, node.chunks, node.accept, as_,
                          tuple(sorted((offered - {as_}) & reads)), node.on_turn)
        self.streams.setdefault(node.source, []).append(plan)
        reading, self._reading = self._reading, as_
        try:
            self._partition(consumer, nodes, offered | {as_}, parent=None, starts_at=0, stream=plan)
        finally:
            self._reading = reading

    def _check_loop(self, loop: Loop, available: set[str], where: str, around: tuple[Loop, ...],
                    entering: Step | None, written: dict[str, set[str]]) -> None:
        """Check `loop` (inside the loops `around`, outermost first), entered
        after `entering` (the step just before it at its level, or None), and
        add what it writes to `available`."""
        if loop.until is None:
            raise self.fail(where, "the loop has no stop rule")
        if not loop.body:
            raise self.fail(where, "the loop has no body")
        rules = loop.until.rules()
        if around and any(isinstance(r, HostStop) for r in rules):
            raise self.fail(where, "HostStop ends a partition's top-level loop; a nested loop cannot use it")
        if self._reading is None and any(isinstance(r, StreamDone) for r in rules):
            raise self.fail(where, "StreamDone ends a loop of a stream's consumer; this partition reads no stream")
        for rule in rules:
            if isinstance(rule, MaxSteps) and rule.value is not None and rule.value not in available:
                raise self.fail(where, f"caps its steps at '{rule.value}', which nothing writes before the loop")
        if entering is not None and loop.value in entering.outputs:
            both = [o.value for o in around if o.value in entering.outputs]
            if both:
                raise self.fail(where, f"the step before it writes the values of two loops ('{both[0]}' and "
                                       f"'{loop.value}')")
        collect = loop.collect
        if collect is not None:
            for value in collect.first:
                if value not in available or (entering is not None and value in entering.outputs
                                              and loop.value in entering.outputs):
                    raise self.fail(where, f"collects '{value}' first, which is not written before the loop "
                                           f"starts")
        inner = set(available)
        direct: set[str] = set()
        prev: Step | None = None
        for child in loop.body:
            if isinstance(child, Step):
                label = f"{where}/{child.label}"
                self._check_step(child, inner, label, in_loop=True)
                ours = [o.value for o in (*around, loop) if o.value in child.outputs]
                if len(ours) > 1:
                    raise self.fail(label, f"writes the values of two loops it runs in ({ours})")
                inner |= set(child.outputs)
                direct |= set(child.outputs)
                _first_writes(written, child.outputs, inner)
                prev = child
            elif isinstance(child, Loop):
                self._check_loop(child, inner, f"{where}/loop {child.step.label}", (*around, loop), prev, written)
                prev = None
            elif isinstance(child, Each):
                self._each(child, inner, f"{where}/each", (*around, loop), in_loop=True)
                prev = None
            elif isinstance(child, Emit):
                self.emits[child.value] = child
            else:
                raise self.fail(where, f"a loop body holds steps, loops and emits, not {type(child).__name__}")
        if loop.value not in direct:
            raise self.fail(where, f"its value '{loop.value}' is not written by a step of its body")
        if collect is not None:
            if collect.each not in _writes(loop) and not (entering and collect.each in entering.outputs):
                raise self.fail(where, f"collects '{collect.each}', which nothing in the loop writes")
            inner.add(collect.into)
            self.kinds[collect.into] = Kind.TENSOR
            self.collected.add(collect.into)
            _first_writes(written, (collect.into,), inner)
        available |= inner


def _writes(loop: Loop) -> set[str]:
    """Every value a step inside `loop` writes, nested loops included."""
    out: set[str] = set()
    for child in loop.body:
        if isinstance(child, Step):
            out |= set(child.outputs)
        elif isinstance(child, Loop):
            out |= _writes(child) | ({child.collect.into} if child.collect else set())
    return out


def _first_writes(written: dict[str, set[str]], values: tuple[str, ...], available: set[str]) -> None:
    for value in values:
        written.setdefault(value, set(available))


def _reads(nodes: tuple) -> set[str]:
    """Every value the steps among `nodes` read (and their loops' caps and
    collections), inside loops, fan-outs and the consumers of their streams
    too."""
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, Step):
            out |= set(node.inputs)
        elif isinstance(node, Loop):
            out |= _reads(node.body)
            rules = node.until.rules() if node.until is not None else ()
            out |= {r.value for r in rules if isinstance(r, MaxSteps) and r.value is not None}
            out |= set(node.collect.first) if node.collect is not None else set()
        elif isinstance(node, FanOut):
            for branch in node.branches:
                out |= _reads(branch)
        elif isinstance(node, Stream) and node.into is not None:
            out |= _reads(node.into.nodes if isinstance(node.into, Partition) else (node.into,))
    return out
