"""Components and the signatures of their modes: what a mode reads and
writes, by name and kind, and how it touches the KV cache.

A mode may be declared by name alone (the forms every model used so far): a
KV component's string mode then reads token ids and, when the component
samples, writes one sampled token per row; a plain component's string mode
takes its inputs by position. A `Mode` says it all: named `In`s and `Out`s
with their `Kind`, whether it appends to, only reads, or restarts the row's
KV cache, and which input carries a row's new tokens. `compile.py` checks a
walk's bindings against these signatures at model load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal


class Kind(Enum):
    """What a value is, as a mode reads or writes it."""

    IDS = "ids"              # int64 token ids, packed over rows along the tokens
    EMBEDS = "embeds"        # rows of vectors packed along the tokens; with `In.at`, spliced at placeholder ids
    POSITIONS = "positions"  # [axes, n] int64 positions along the tokens (M-RoPE: 3 axes)
    TENSOR = "tensor"        # one tensor per row, stacked over rows (or a list when ragged)
    HIDDEN = "hidden"        # an output: hidden states of a row's last token, or of all its tokens
    TOKEN = "token"          # an output: one token per row, sampled from the mode's logits
    INDEX = "index"          # a built-in [B] int64: `@i` (the loop's iteration), `@chunk` (the stream chunk)


# what an input of each kind may be fed from (a walk input, whose kind is not declared, feeds anything)
ACCEPTS: dict[Kind, frozenset[Kind]] = {
    Kind.IDS: frozenset({Kind.IDS, Kind.TOKEN}),
    Kind.EMBEDS: frozenset({Kind.EMBEDS, Kind.HIDDEN, Kind.TENSOR}),
    Kind.POSITIONS: frozenset({Kind.POSITIONS, Kind.TENSOR}),
    Kind.TENSOR: frozenset({Kind.TENSOR, Kind.HIDDEN, Kind.EMBEDS, Kind.TOKEN, Kind.IDS, Kind.INDEX}),
    Kind.INDEX: frozenset({Kind.INDEX}),
}
INPUT_KINDS = frozenset(ACCEPTS)
OUTPUT_KINDS = frozenset({Kind.TOKEN, Kind.HIDDEN, Kind.TENSOR, Kind.EMBEDS, Kind.POSITIONS, Kind.IDS})
BUILTINS = {"@i": Kind.INDEX, "@chunk": Kind.INDEX}  # values no step writes: the runtime supplies them


@dataclass(frozen=True)
class In:
    """A named input. `at`: embeddings go where the query's ids equal this
    placeholder id; `axes`: rows of a POSITIONS input; `ragged`: rows of
    different shapes come as a list; `optional`: a step may leave it unbound;
    `host`: the mode gets it on the host, for values it reads in Python (a
    prompt's ids), which reading back from the device would wait for every
    step in flight. Meant for values a request brings, which are on the
    host already."""

    name: str
    kind: Kind
    at: int | None = None
    axes: int = 1
    ragged: bool = False
    optional: bool = False
    host: bool = False


@dataclass(frozen=True)
class Out:
    """A named output; `rows`: a HIDDEN output of each row's last token, or
    of all its tokens."""

    name: str
    kind: Kind
    rows: Literal["last", "all"] = "last"


@dataclass(frozen=True)
class Mode:
    """One kind of step of a component.

    `kv`: "append" keeps the step's tokens in the row's cache, "read" attends
    over the cache without keeping them, "none" has no cache. `query`: for a
    KV mode, the IDS or EMBEDS input that holds a row's new tokens. `causal`:
    among the step's own tokens. `reset`: the row's cache starts over at this
    step. `graph`: a decode-like mode, worth CUDA graphs at batch buckets.
    `draws`: tokens the mode samples itself per row and step (a talker frame
    mode running its code predictor inside), through `TokenBatch.draw`, under
    the sampling key its step names (`Step(draws=)`)."""

    name: str
    inputs: tuple[In, ...]
    outputs: tuple[Out, ...]
    kv: Literal["none", "append", "read"] = "none"
    query: str | None = None
    causal: bool = True
    reset: bool = False
    graph: bool = False
    draws: int = 0

    def __post_init__(self) -> None:
        names = [i.name for i in self.inputs]
        if len(set(names)) != len(names) or len({o.name for o in self.outputs}) != len(self.outputs):
            raise ValueError(f"mode '{self.name}': a name is declared twice")
        bad = [i.name for i in self.inputs if i.kind not in INPUT_KINDS]
        bad += [o.name for o in self.outputs if o.kind not in OUTPUT_KINDS]
        if bad:
            raise ValueError(f"mode '{self.name}': {bad} have kinds that cannot go that way")
        if self.kv not in ("none", "append", "read"):
            raise ValueError(f"mode '{self.name}': kv must be none, append or read, not {self.kv!r}")
        if self.draws < 0:
            raise ValueError(f"mode '{self.name}': draws must be 0 or more, not {self.draws}")
        if self.kv == "none":
            if self.query is not None or self.reset or self.draws:
                raise ValueError(f"mode '{self.name}': query, reset and draws are for KV modes")
            return
        query = next((i for i in self.inputs if i.name == self.query), None)
        if query is None or query.kind not in (Kind.IDS, Kind.EMBEDS) or query.optional:
            raise ValueError(f"mode '{self.name}': a KV mode names one required IDS or EMBEDS input as its "
                             f"query (got {self.query!r})")

    def input(self, name: str) -> In | None:
        return next((i for i in self.inputs if i.name == name), None)

    def output(self, name: str) -> Out | None:
        return next((o for o in self.outputs if o.name == name), None)


@dataclass(frozen=True)
class Component:
    """A model part with weights and one batched entry point per mode.

    `modes`: names, or `Mode`s with signatures (kept as `signatures`; `modes`
    always holds the names). `kv_cache`: the component keeps a paged KV cache
    per row. `samples`: its name-only modes return logits that the runtime
    samples into one token per row. `state`: it keeps a fixed-size state per
    row (a recurrent layer's, or a streaming decoder's caches and buffers), in
    a slot the runtime hands each row at its first step and takes back when
    its partition ends (`Model.state_spec` gives its tensors); a plain
    component's modes get it as the keyword argument `state`. `own_stream`:
    on CUDA its steps run on a stream of their own, overlapping the other
    components' steps (a vocoder beside the decoder feeding it); what it
    writes may only reach the client, as nothing orders another component's
    reads after its steps (the walks are checked). A KV component's decode
    groups run on a stream of their own anyway. `urgent`: on CUDA those
    streams run at high priority: a long chain of small kernels (a talker
    frame's code predictor) that other components' bulk work (an MoE decode
    filling every SM) would otherwise hold up, as the hardware interleaves
    their blocks. `apart`: of a sampling KV component's name-only modes,
    those that compute differently from the others: their rows never share
    a step with another mode's (by default a new row's prompt may run inside
    a running decode group's step, through the group's mode).
    """

    modes: tuple[str | Mode, ...]
    kv_cache: bool = False
    samples: bool = False
    state: bool = False
    own_stream: bool = False
    urgent: bool = False
    apart: tuple[str, ...] = ()
    signatures: dict[str, Mode] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        declared = {m.name: m for m in self.modes if isinstance(m, Mode)}
        names = tuple(m.name if isinstance(m, Mode) else m for m in self.modes)
        if len(set(names)) != len(names):
            raise ValueError(f"a mode is declared twice in {names}")
        if not self.kv_cache and any(m.kv != "none" for m in declared.values()):
            raise ValueError("a mode touches the KV cache of a component without one")
        if self.own_stream and self.kv_cache:  # its item steps, forks and swaps of KV rows run on the worker's stream
            raise ValueError("a component with a KV cache runs on the worker's stream (own_stream is for plain ones)")
        if any(m not in names for m in self.apart):
            raise ValueError(f"apart names modes {self.apart} the component does not have ({names})")
        object.__setattr__(self, "modes", names)
        object.__setattr__(self, "signatures", {**self.signatures, **declared})

    @property
    def position_axes(self) -> int:
        """Axes of the positions its modes take (3 for M-RoPE): the most any
        declared POSITIONS input has, 1 when none declares one."""
        return max((i.axes for m in self.signatures.values() for i in m.inputs if i.kind is Kind.POSITIONS),
                   default=1)

    def signature(self, mode: str) -> Mode | None:
        """`mode`'s signature: declared, or implied by a name-only mode of a
        sampling KV component (token ids in, a sampled token out). None: any
        other name-only mode, whose values bind by position."""
        if mode in self.signatures:
            return self.signatures[mode]
        if not (self.kv_cache and self.samples) or mode not in self.modes:
            return None
        return _implied(mode)


@functools.lru_cache(maxsize=64)
def _implied(mode: str) -> Mode:
    """The signature a name-only mode of a sampling KV component implies; one
    (frozen) object per mode name, asked for on every request's intake."""
    return Mode(mode, (In("ids", Kind.IDS),), (Out("token", Kind.TOKEN),), kv="append", query="ids",
                graph=mode == "decode")
