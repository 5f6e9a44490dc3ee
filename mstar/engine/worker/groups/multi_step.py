"""How many decode steps a group's next launch may run back to back
(`--num-scheduler-steps`): a group's rows in, a count of steps out.

Several steps a launch divide what a step costs the host once, rather than
per step (the scheduler's plan, the launch's bookkeeping, reading the
tokens back, the routing and the report), by the steps it runs. The steps
themselves are the single step's, one after the other on the device: each
row's drawn token goes straight into the next step's input, and the rows
stop only when the launch is read, as they do one step late today. So a
launch runs several steps only where that late stop changes nothing a row
keeps: its tokens drawn after a stop id are never routed, never marked seen
(`LoopGroup.live`), and write KV past the length the row hands back.

A launch also ends at the step that writes the item cutting a stream's first
chunk of a turn (`Streams.first_cut_room`, less the steps of the launch not
read yet), and launches run one step from then until the consumer's step on
that chunk has run: its first pass (a speech stream's first audio) is queued
as soon after that item as with one step a launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar.engine.worker.groups.loop_group import LoopGroup


def steps_room(group: LoopGroup, most: int) -> int:
    """Steps (1 to `most`) the group's next launch may run: one while any
    row needs a decision between two steps, else as many as every row may
    still write before its cap (so that a row reaches it only at the
    launch's last step) and no stream watched for its first chunk is cut
    before the last step."""
    if most <= 1 or group.most_steps <= 1 or not len(group.rows):
        return 1
    shape = group.shape
    if shape.reads_more or shape.extras or shape.fed is not None:
        return 1  # a step that reads what the last one kept, or an item of a stream, is planned one at a time
    st = group.sampling
    if st is None or st.any_logprobs or st.any_output_penalty or group.outputs is not None or group.banning:
        # logprobs are packed a step at a time; output counts and banned stop ids change between steps
        return 1
    # numpy over the host tables: a few hundred ints, where a torch op costs more than its work and lets go
    # of the GIL (the event loop then holds it)
    if int(group.slots.numpy().max()) >= 0:
        return 1  # per-row state is updated in place: a step past a stop would change what the row keeps
    room = int((group.caps.numpy() - group.counts.numpy()).min())
    first = group.first_cut_room(group.component) if group.first_cut_room is not None else None
    if first is not None:  # the launch in flight may write that many items before this one starts
        room = min(room, first - group.unread_steps)
    return max(1, min(most, room))
