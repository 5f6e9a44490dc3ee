"""Which token loops run as decode groups, and what a group step reads and
keeps besides the token it samples: a step's signature and bindings in, a
`GroupShape` out (or None: the loop runs item by item).

A group step reads its loop's token back as its query. It may also read
values it wrote itself the step before (carried: a talker's last hidden
state), and one item a step of the stream its partition reads (fed: the
thinker's next text token); it may draw tokens inside the mode (a code
predictor's codes). Whatever it writes besides the token it keeps per step
(`Pending.extras`), each output one row of fixed shape per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.graph import Component, Items, Kind, Step, StreamPlan, step_bindings


def graph_outputs(spec: Component, mode: str) -> tuple[str, ...] | None:
    """What a decode CUDA graph of `mode` keeps: "logits", and the hidden
    states its signature declares besides its token; None when a graph
    cannot serve it (a mode taking more than its token ids, or returning
    more than a token and last-token hidden states)."""
    sig = spec.signatures.get(mode)
    if sig is None:
        return ("logits",)
    tokens = [o for o in sig.outputs if o.kind is Kind.TOKEN]
    hidden = [o.name for o in sig.outputs if o.kind is Kind.HIDDEN and o.rows == "last"]
    if len(tokens) != 1 or len(hidden) + 1 != len(sig.outputs) or [i.name for i in sig.inputs] != [sig.query]:
        return None
    return ("logits", *hidden)


@dataclass(frozen=True)
class GroupShape:
    """`extras`: signature output name -> walk value, kept per step;
    `carried`: signature input name -> the output name whose last value it
    reads; `fed`: the input taking the stream's next item each step;
    `draws`: (sampling key, draws a step) of the mode's own draws."""

    extras: dict[str, str] = field(default_factory=dict)
    carried: dict[str, str] = field(default_factory=dict)
    fed: str | None = None
    draws: tuple[str, int] | None = None

    @property
    def reads_more(self) -> bool:
        """The step reads more than its token: it runs through the mode's
        own call, not a plain decode."""
        return bool(self.carried or self.fed or self.draws)


def group_shape(spec: Component | None, step: Step, value: str,
                stream: StreamPlan | None = None) -> GroupShape | None:
    """Whether rows of `step` (its loop's `value` read back as its query) may
    run in a group, and what its steps read and keep; `stream`: the one the
    step's partition reads, if any; `spec` None: a name-only component.
    None: the step runs item by item."""
    sig = spec.signatures.get(step.mode) if spec is not None else None
    if sig is None:
        return GroupShape() if step.outputs == (value,) and step.inputs == (value,) else None
    reads, writes = step_bindings(step, sig)
    token = next((o.name for o in sig.outputs if o.kind is Kind.TOKEN), "")
    if reads.get(sig.query) != value or writes.get(token) != value:
        return None
    extras = {name: v for name, v in writes.items() if v != value}
    for name in extras:
        out = sig.output(name)
        if out.kind not in (Kind.HIDDEN, Kind.TENSOR) or out.rows != "last":
            return None
    carried: dict[str, str] = {}
    fed = None
    for name, v in reads.items():
        if name == sig.query:
            continue
        inp = sig.input(name)
        written = [o for o, w in extras.items() if w == v]
        if written and not inp.ragged and inp.kind in (Kind.TENSOR, Kind.HIDDEN):
            carried[name] = written[0]
        elif (stream is not None and v == stream.as_ and fed is None and isinstance(stream.chunks, Items)
              and stream.chunks.fill is not None and stream.on_turn == "segment" and inp.kind is Kind.TENSOR):
            fed = name  # one token id a step; once the stream is over, the fill: a row never waits at its end
        else:
            return None
    draws = (step.draws, sig.draws) if step.draws is not None and sig.draws else None
    return GroupShape(extras, carried, fed, draws)
