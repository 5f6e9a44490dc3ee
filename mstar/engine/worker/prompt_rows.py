"""Which new rows' prompts may run in chunks and start from the prefix
cache, and the keys of their prompts' pages: the walker asks here as it
queues a row's first KV step.

Only steps whose KV depends on nothing but what the keys hash qualify, on a
component without per-row state (a prefix of KV would leave it empty) and no
mode of which restarts its cache in place (that would write over shared
pages). A sampling component's name-only token steps (token ids from
position 0, one token out per row) may also run in parts, with per-row
state too (each chunk goes on from the state the one before left). A step of a mode
with a signature may start from the cache when it reads only token ids,
embeddings standing for some of them (media) and positions, and writes only
its sampled token, last-token states, and states of every prompt token only
where the pages keep those rows (`KVSpec.token_rows`: a cached prefix computes
none, so its rows come from the pages): its page keys hash each token's id,
or for a token an embedding stands for, a digest of that embedding's rows,
and its positions, salted with the rows it keeps (a page written by a step
that kept none has none to give). Such steps run whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import StreamItem
from mstar.graph import Component, Kind, Mode, Step, step_bindings
from mstar.scheduler.prefix_cache import page_keys, page_keys_of

Inputs = dict[str, TensorRef | list[StreamItem] | int]


@dataclass(frozen=True, slots=True)
class PromptRow:
    """What the scheduler may do with a row's first step."""

    chunkable: bool = False        # it may run over several steps, a chunk of its tokens each
    prefix: tuple[bytes, ...] = ()  # the keys of its prompt's full pages, for the prefix cache
    # a name-only prompt's ids, where the cache is on: the row may follow them (`ids`); kept as the
    # tensor because most rows do not follow theirs, and a list of a prompt's ints costs a few us per request
    tokens: torch.Tensor | None = None

    def ids(self) -> list[int]:
        """The prompt's ids a row follows (none without `tokens`)."""
        return [] if self.tokens is None else self.tokens.reshape(-1).tolist()


def prompt_row(store: TensorStore, comp: Component | None, step: Step, inputs: Inputs, row: KVRow,
               page_size: int, caching: bool, token_rows: frozenset[str] = frozenset()) -> PromptRow:
    """How `step`, the first of `row`, may be scheduled (`caching`: its
    component has a prefix cache; `token_rows`: the outputs whose every
    token's row its pages keep)."""
    if row.pages or row.kv_len or row.swapped is not None or row.branch != "main":
        return PromptRow()
    if comp is None or not comp.samples or any(mode.reset for mode in comp.signatures.values()):
        return PromptRow()
    salt = step.component.encode()
    sig = comp.signatures.get(step.mode)
    # a row with per-row state runs as without a cache: a cached prefix would leave its state empty, and its
    # chunks carry the state on in its slot
    caching = caching and not comp.state
    if sig is not None:
        if not caching or not _reusable(sig, step, token_rows):
            return PromptRow()
        # a step that hands on token rows reuses only pages that a step keeping the same rows wrote
        kept = sorted(name for name in step_bindings(step, sig)[1] if name in token_rows)
        salt += b"".join(b"|" + name.encode() for name in kept)
        return PromptRow(prefix=_signed_keys(store, sig, step, inputs, page_size, salt))
    ref = inputs.get(step.inputs[0])
    if not isinstance(ref, TensorRef):
        return PromptRow()
    ids = store.get(ref)
    if ids.is_floating_point():
        return PromptRow()
    if not caching:
        return PromptRow(chunkable=True)
    # what `page_keys` hashes of the ids' ints, in their flat order (a tensor's bytes, C order)
    data = (ids if ids.dtype is torch.int64 and ids.device.type == "cpu" else ids.to("cpu", torch.int64)).numpy()
    return PromptRow(chunkable=True, prefix=page_keys_of(data.tobytes(), page_size, salt=salt), tokens=ids)


def _reusable(sig: Mode, step: Step, token_rows: frozenset[str]) -> bool:
    """A signed step whose KV the prefix cache can stand for (module docstring)."""
    if sig.kv != "append" or sig.query is None or sig.input(sig.query).kind is not Kind.IDS or sig.draws:
        return False
    reads, writes = step_bindings(step, sig)
    if any(sig.input(name).kind not in (Kind.IDS, Kind.EMBEDS, Kind.POSITIONS) for name in reads):
        return False
    outs = [sig.output(name) for name in writes]
    return all(o is not None and (o.kind is Kind.TOKEN or (o.kind is Kind.HIDDEN and o.rows == "last")
                                  or (o.kind is Kind.HIDDEN and o.rows == "all" and o.name in token_rows))
               for o in outs)


def _signed_keys(store: TensorStore, sig: Mode, step: Step, inputs: Inputs, page_size: int,
                 salt: bytes) -> tuple[bytes, ...]:
    """Page keys of a signed prompt: a token an embedding stands for is keyed
    by a digest of its rows (every embeddings input's, a negative id no
    token has), and each token's positions are hashed along."""
    reads = step_bindings(step, sig)[0]
    refs = {name: inputs.get(value) for name, value in reads.items()}
    if not all(isinstance(r, TensorRef) for r in refs.values()):
        return ()
    ids = store.get(refs[sig.query]).reshape(-1).tolist()
    media: dict[int, "hashlib.blake2b"] = {}
    for name, ref in refs.items():
        inp = sig.input(name)
        if inp.kind is not Kind.EMBEDS:
            continue
        at = [i for i, t in enumerate(ids) if t == inp.at] if inp.at is not None else list(range(len(ids)))
        rows = store.get(ref)
        if rows.dim() == 0 or rows.shape[0] != len(at):
            return ()  # the step itself reports the mismatch
        if not len(at):
            continue
        data = rows.reshape(len(at), -1).contiguous().cpu().view(torch.uint8).numpy()
        for i, row in zip(at, data):
            media.setdefault(i, hashlib.blake2b(name.encode(), digest_size=8)).update(row.tobytes())
    for i, h in media.items():
        ids[i] = -1 - int.from_bytes(h.digest()[:7], "little")
    columns: list[list[int]] = []
    pos = next((n for n in refs if sig.input(n).kind is Kind.POSITIONS), None)
    if pos is not None:
        columns = store.get(refs[pos]).to("cpu", torch.long).reshape(sig.input(pos).axes, -1).tolist()
    return page_keys(ids, page_size, salt=salt, columns=columns)
