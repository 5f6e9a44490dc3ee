"""A token loop's row joining its decode group, on the worker thread: the
walker, at a loop's step, hands the row here; it joins the `LoopGroup` of its
component's mode and step shape, whatever its walk (made on first use, with
the component's CUDA stream), or runs item by item when the loop does not
qualify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.engine.worker.groups.group_shape import group_shape
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.worker.stop_rules import loop_key, stop_ids
from mstar.graph import Run, step_bindings

if TYPE_CHECKING:  # the walker calls in here: no import at run time
    from mstar.engine.worker.walker import Walker


def join_group(walker: Walker, part: PartitionRun, ins: Run) -> bool:
    """Hand a token loop to its `LoopGroup`; False when the loop does not
    qualify (a body other than one step of a sampling KV component reading
    back its own token, and what `group_shape` allows besides; a
    collection, no write cap, or pages that do not cover the cap) and runs
    item by item. A row whose step reads its stream joins once the next
    item is there (until then it parks as any consumer does)."""
    assert ins.checks is not None
    loop = part.plan.loops[ins.checks].loop
    step = ins.step
    if (ins.enters or loop.body != (step,) or loop.collect is not None
            or step.component not in walker.token_loops):
        return False
    comp = walker.components.get(step.component)
    row = part.row(step.component)
    shape = group_shape(comp, step, loop.value, part.plan.stream)
    if shape is None:
        return False  # reads or writes what a group does not carry
    more_input = part.request.walk.more_input is not None
    if more_input and (shape.reads_more or (comp is not None and comp.state)):
        # a group computes a step past a row's stop before it knows; a state updated in place (or a stream
        # item taken) by that dead step would be wrong for the next turn
        return False
    if shape.fed is not None:
        if not walker.streams.ready(part) or _reads_stream_later(part, ins):
            return False
    if row.swapped is not None:  # preempted while it waited outside: an item step swaps its KV back first
        return False
    frame = part.loops[-1]
    cap, count = frame.cap, frame.count
    pool = walker.pools[step.component]
    if cap is None or (not row.grows and pool.pages_for(row.kv_len + cap - count) > len(row.pages)):
        return False
    ceiling = part.turn_ceiling(walker.max_model_len) if len(part.loops) == 1 else None
    if ceiling is not None:  # a turn leaving room for its next piece of input
        cap = min(cap, count + max(ceiling - row.kv_len, 0))
    # rows of any walk whose loop steps this mode reading and keeping the same share a group (and its steps)
    key = (step.component, step.mode, tuple(sorted(shape.extras.items())), tuple(sorted(shape.carried.items())),
           shape.fed, shape.draws)
    group = walker.groups.get(key)
    if group is None:
        stream = None
        if walker.device.type == "cuda":
            stream = walker.group_streams.get(step.component)
            if stream is None:
                urgent = comp is not None and comp.urgent
                stream = walker.group_streams[step.component] = torch.cuda.Stream(walker.device,
                                                                                 priority=-1 if urgent else 0)
        group = walker.groups[key] = LoopGroup(step.component, step.mode, walker.device, shape,
                                             comp.position_axes if comp is not None else 1, stream,
                                             walker.scheduler.steps.most, walker.streams.first_cut_room)
        walker.scheduler.add_group((step.component, step.mode), group)
    if not len(group):
        group.ticket = walker.scheduler.ticket()
    token = walker.store.take(part.values.pop(loop.value), part.request_id)
    reads = step_bindings(step, comp.signatures[step.mode])[0] if shape.carried else {}
    carried = {name: walker.store.take(part.values.pop(reads[name]), part.request_id) for name in shape.carried}
    group.join(part, token, count, cap, stop_ids(part, loop), carried,
               part.request.sampling[loop_key(part, loop)].min_tokens)
    part.busy = True
    return True

def _reads_stream_later(part: PartitionRun, ins: Run) -> bool:
    """A step after `ins`'s top-level loop (or around it) reads the stream
    too: a group's speculative step past a row's stop takes an item, which
    such a step would then miss."""
    assert part.plan.stream is not None
    if len(part.loops) != 1:
        return True
    program = part.plan.program
    return any(isinstance(i, Run) and part.plan.stream.as_ in i.step.inputs for i in program[part.pc + 1:])
