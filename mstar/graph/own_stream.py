"""What a walk lets out of a component that runs on a CUDA stream of its own
(`Component.own_stream`): the walk's nodes and the model's components in,
the values such a component writes (and the collections of them) out, each
with its component. Nothing orders the worker's stream after that stream,
so no other component's step may read them, nor a loop count its rounds by
one; `compile_walk` refuses a walk that would."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass

from mstar.errors import WalkError
from mstar.graph.nodes import Loop, Step
from mstar.graph.signatures import Component
from mstar.graph.stops import MaxSteps


def own_stream_values(nodes: tuple, components: dict[str, Component],
                      fail: Callable[[str, str], WalkError]) -> dict[str, str]:
    """Values written anywhere in the walk by a component on its own stream
    (a loop's next round reads what its last wrote, so before the steps are
    checked in order), and the collections of them -> that component."""
    every = list(_all_nodes(nodes))
    out: dict[str, str] = {}
    for node in every:
        comp = components.get(node.component) if isinstance(node, Step) else None
        if comp is not None and comp.own_stream:
            out.update(dict.fromkeys(node.outputs, node.component))
    loops = [n for n in every if isinstance(n, Loop)]
    grew = True
    while grew:  # collections of collections
        grew = False
        for loop in loops:
            c = loop.collect
            if c is not None and c.into not in out:
                source = next((v for v in (c.each, *c.first) if v in out), None)
                if source is not None:
                    out[c.into], grew = out[source], True
    for loop in loops:
        for rule in loop.until.rules() if loop.until is not None else ():
            if isinstance(rule, MaxSteps) and rule.value in out:  # its cap is read on the worker's stream
                raise fail(f"loop {loop.value}", f"counts its rounds by '{rule.value}', which '{out[rule.value]}' "
                                                 f"writes on a CUDA stream of its own (own_stream)")
    return out


def _all_nodes(nodes: tuple) -> Iterator[object]:
    """Every node of a walk, nested ones included (steps, loops, partitions,
    streams, branches), through their dataclass fields."""
    for node in nodes:
        if isinstance(node, (list, tuple)):
            yield from _all_nodes(tuple(node))
        elif is_dataclass(node) and not isinstance(node, type):
            yield node
            yield from _all_nodes(tuple(getattr(node, f.name) for f in fields(node)))
