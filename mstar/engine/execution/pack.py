"""Packing by signature, for modes that declare one (`graph.Mode`).

KV modes: each row's inputs, by signature name, in; one `TokenBatch` out,
with the rows' query ids packed along T, their positions (given by a
POSITIONS input, else each row's next ones), every EMBEDS input with the
packed tokens it stands for, and the other inputs stacked over rows in
`extra`. Then the other way: what the mode returned, named by the step's
binding, a rows="all" output cut into one tensor per row.

Plain modes: each input stacked over rows (a list when ragged) under its
signature name, and the outputs named by the binding.

Any mode: the stream chunks of token ids that every row of a step holds on
the host (a codec's windows) made into one tensor (`host_id_rows`), and the
rows' slots of a component's per-row state (`state_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mstar.engine.movement.transfer import to_device
from mstar.kernels.host_copy import together_on
from mstar.engine.worker.kv_rows import KVRow
from mstar.graph import In, Kind, Mode
from mstar.types import AttentionContext, StateRows, TokenBatch

if TYPE_CHECKING:
    from mstar.scheduler import WorkItem
    from mstar.engine.memory.kv_cache import KVCache
    from mstar.engine.memory.state_slots import StatePool

# the attention plan of a step: query_start [B + 1], context lens [B], page tables, causal in
Planner = Callable[[torch.Tensor, torch.Tensor, list[list[int]], bool], AttentionContext]


@dataclass(eq=False)
class PackedRows:
    batch: TokenBatch
    ids: list[torch.Tensor]         # each row's query ids (the repetition penalty marks them; none for embeddings)
    lens: list[int]                 # each row's new tokens
    rope_deltas: list[int | None]   # each row's rope delta once the step has run; None: as it was


def pack_kv(rows: list[dict[str, torch.Tensor]], reads: list[dict[str, str]], kv: list[KVRow],
            sig: Mode, axes: int, plan: Planner, device: torch.device,
            skips: list[int] | None = None) -> PackedRows:
    """`rows[i]`: row i's inputs by signature name; `reads[i]`: the walk value
    each came from (errors name it); `kv[i]`: its KV row (a `reset` mode
    starts it over); `axes`: of the component's positions; `skips[i]`: the
    first tokens of row i's query whose KV its pages hold already (a prefix
    cache hit): the step computes the rest, with their positions and the
    embeddings that stand for them.
    Raises `ValueError` for a row whose inputs disagree with its tokens (the
    worker then runs the rows alone, and that row fails by itself)."""
    assert sig.query is not None
    query = sig.input(sig.query)
    skips = skips or [0] * len(rows)
    full: list[torch.Tensor] = []
    for row in rows:
        q = row[query.name]
        # a query of embeddings stands for every token of the row: its ids are placeholders
        full.append(q.reshape(-1) if query.kind is Kind.IDS else torch.zeros(q.shape[0], dtype=torch.long))
    if any(skips):
        rows = [_skipped(row, sig, ids, skip) for row, ids, skip in zip(rows, full, skips)]
    ids = [t[skip:] for t, skip in zip(full, skips)]
    lens = [t.numel() for t in ids]
    query_start = torch.zeros(len(rows) + 1, dtype=torch.long)
    query_start[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    cached = [0 if sig.reset else r.kv_len for r in kv]
    starts = [0 if sig.reset else r.start for r in kv]
    positions, deltas = _positions(rows, reads, cached, sig, axes, lens, starts)
    host_ids = [t.cpu() for t in ids] if any(i.at is not None for i in sig.inputs) else ids
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    extra: dict[str, Any] = {}
    pos_input = _positions_input(sig)
    for inp in sig.inputs:
        if inp.kind is Kind.EMBEDS:
            spliced = _splice(inp, rows, reads, host_ids, lens, query_start, sig.query, device)
            if spliced is not None:
                embeds[inp.name] = spliced
        elif inp.name != sig.query and inp is not pos_input and any(inp.name in row for row in rows):
            extra[inp.name] = stacked(inp, [row.get(inp.name) for row in rows], device)
    ctx = torch.tensor(cached, dtype=torch.long)
    input_ids, flat_positions, logits_index, start_positions = step_indices(
        ids, torch.cat(positions, dim=-1), query_start, device, torch.tensor(starts, dtype=torch.long))
    batch = TokenBatch(
        input_ids=input_ids,
        positions=flat_positions,
        query_start=query_start,
        logits_index=logits_index,
        attn=plan(query_start, ctx, [r.pages for r in kv], sig.causal),
        embeds=embeds,
        extra=extra,
        start_positions=start_positions,
    )
    # embeddings' placeholder ids are no tokens the row saw (a talker's repetition penalty is over its own
    # codes); a repetition penalty sees the whole prompt, cached or not
    seen = full if query.kind is Kind.IDS else [t[:0] for t in ids]
    return PackedRows(batch, seen, lens, deltas)


def _skipped(row: dict[str, torch.Tensor], sig: Mode, ids: torch.Tensor, skip: int) -> dict[str, torch.Tensor]:
    """Row inputs less their first `skip` tokens: the query's, the rows of
    embeddings standing for them, their positions (a given input keeps its
    largest position, which sets the row's rope delta, in its last token)."""
    if not skip:
        return row
    out = dict(row)
    for inp in sig.inputs:
        value = row.get(inp.name)
        if value is None:
            continue
        if inp.name == sig.query:
            out[inp.name] = value.reshape(-1)[skip:] if inp.kind is Kind.IDS else value[skip:]
        elif inp.kind is Kind.EMBEDS:
            out[inp.name] = value[int((ids[:skip] == inp.at).sum()):] if inp.at is not None else value[skip:]
        elif inp.kind is Kind.POSITIONS:
            pos = value.reshape(inp.axes, -1)
            if pos.shape[-1] > skip and pos[:, skip:].max() < pos.max():
                raise ValueError(f"the cached prefix of '{inp.name}' holds its largest position")
            out[inp.name] = pos[:, skip:]
    return out


def step_indices(ids: list[torch.Tensor], positions: torch.Tensor, query_start: torch.Tensor,
                 device: torch.device, starts: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A step's packed token ids, positions, logits rows (each row's last
    token) and, when given, its rows' start positions, on `device`: those on
    the host in one copy, which never waits for the stream."""
    flat_ids = torch.cat(ids).long()
    host = [positions, query_start[1:] - 1] + ([starts] if starts is not None else [])
    ids_on_host = flat_ids.device.type == "cpu"
    on_device = together_on(host + [flat_ids] if ids_on_host else host, device)
    input_ids = on_device.pop() if ids_on_host else flat_ids.to(device)
    return input_ids, on_device[0], on_device[1], on_device[2] if starts is not None else None


def _positions_input(sig: Mode) -> In | None:
    return next((i for i in sig.inputs if i.kind is Kind.POSITIONS), None)


def _positions(rows: list[dict[str, torch.Tensor]], reads: list[dict[str, str]], cached: list[int],
               sig: Mode, axes: int, lens: list[int], starts: list[int],
               ) -> tuple[list[torch.Tensor], list[int | None]]:
    """The rows' positions ([n], or [axes, n] when the component takes
    several axes), to be joined along their last axis, and the rope delta a
    row given its positions moves to."""
    given_in = _positions_input(sig)
    if given_in is None or not any(given_in.name in row for row in rows):
        # every row goes on from its start: one pass for the batch (a decode step's rows, one token each)
        n = torch.tensor(lens, dtype=torch.long)
        flat = torch.arange(int(n.sum())) + torch.repeat_interleave(
            torch.tensor(starts, dtype=torch.long) - (torch.cumsum(n, 0) - n), n)
        return [flat if axes == 1 else flat.expand(axes, -1)], [None] * len(rows)
    out: list[torch.Tensor] = []
    deltas: list[int | None] = []
    for row, read, kv_len, n, start in zip(rows, reads, cached, lens, starts):
        given = row.get(given_in.name) if given_in is not None else None
        if given is None:
            p = torch.arange(start, start + n)
            out.append(p if axes == 1 else p.expand(axes, n))
            deltas.append(None)
            continue
        assert given_in is not None
        p = given.to("cpu", torch.long).reshape(given_in.axes, -1)
        if p.shape[-1] != n:
            raise ValueError(f"'{read[given_in.name]}' holds positions of {p.shape[-1]} tokens; the row brings "
                             f"{n} ('{read[sig.query]}')")
        out.append(p.reshape(-1) if axes == 1 else p.expand(axes, n))
        # a row's next position, less what its cache will hold: decode steps go on from there
        deltas.append(int(p.max()) + 1 - (kv_len + n) if n else None)
    return out, deltas


def _splice(inp: In, rows: list[dict[str, torch.Tensor]], reads: list[dict[str, str]], ids: list[torch.Tensor],
            lens: list[int], query_start: torch.Tensor, query: str, device: torch.device,
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An EMBEDS input's rows [Te, ...] and the packed tokens [Te] they go to:
    the row's tokens equal to its placeholder `at`, else every token of it."""
    taken, index = [], []
    for i, row in enumerate(rows):
        emb = row.get(inp.name)
        if emb is None:
            continue
        if inp.at is not None:
            at = (ids[i] == inp.at).nonzero().flatten()
            if at.numel() != emb.shape[0]:
                raise ValueError(f"'{reads[i][inp.name]}' has {emb.shape[0]} rows for {at.numel()} placeholder "
                                 f"tokens ({inp.at}) in '{reads[i][query]}'")
        else:
            at = torch.arange(lens[i])
            if emb.shape[0] != lens[i]:
                raise ValueError(f"'{reads[i][inp.name]}' has {emb.shape[0]} rows for {lens[i]} tokens")
        taken.append(to_device(emb, device))
        index.append(at + int(query_start[i]))
    if not taken:
        return None
    return torch.cat(taken), to_device(torch.cat(index), device)


def stacked(inp: In, values: list[torch.Tensor | None], device: torch.device) -> torch.Tensor | list:
    """One input over rows: stacked [B, ...], or a list when it is ragged, its
    rows differ in shape, or some rows leave it out (None); on the host when
    the input asks for it."""
    if inp.host:
        device = torch.device("cpu")
    if not inp.ragged and all(v is not None for v in values) and len({tuple(v.shape) for v in values}) == 1:
        if len({v.device for v in values}) == 1:
            return to_device(torch.stack(values), device)
        return torch.stack([to_device(v, device) for v in values])
    return [None if v is None else to_device(v, device) for v in values]


def kv_outputs(out: Mapping[str, Any], sig: Mode, writes: dict[str, str], lens: list[int],
               tokens: torch.Tensor | None, label: str) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """What a KV mode returned, by walk value: the TOKEN output is `tokens`
    (sampled from its "logits"); a HIDDEN rows="all" output [T, ...] becomes
    one tensor per row; anything else is kept as returned ([B, ...] or a list)."""
    values: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name, value in writes.items():
        spec = sig.output(name)
        assert spec is not None
        if spec.kind is Kind.TOKEN:
            assert tokens is not None
            values[value] = tokens
            continue
        if name not in out:
            raise RuntimeError(f"{label} returned {sorted(out)}, not '{name}'")
        data = out[name]
        values[value] = list(torch.split(data, lens)) if spec.rows == "all" else data
    return values


def page_token_rows(values: dict[str, torch.Tensor | list[torch.Tensor]], cache: KVCache, sig: Mode,
                    writes: dict[str, str], kv: list[KVRow], lens: list[int], skips: list[int],
                    slot_mapping: torch.Tensor | None = None) -> None:
    """The rows="all" outputs the pages keep (`KVSpec.token_rows`), in place
    in `values` (`kv_outputs`'): each row's new tokens' rows written into its
    pages at their slots, and the rows of the prefix a cache hit gave it (its
    query's first `skips[i]` tokens, computed by an earlier prompt) read back
    in front, so the output covers the whole query either way. Before the
    rows advance: a row's new tokens start at its `kv_len`. `slot_mapping`:
    the step's attention plan's slots of its new tokens, packed row after
    row (then the writes are one copy and only cache hits look up slots)."""
    if slot_mapping is not None and slot_mapping.numel() != sum(lens):
        slot_mapping = None
    for name, value in writes.items():
        if name not in cache.rows:
            continue
        out = values[value]
        assert isinstance(out, list)
        if slot_mapping is not None and slot_mapping.numel():
            cache.write_rows(name, slot_mapping, torch.cat([mine for mine, n in zip(out, lens) if n]))
        whole = []
        for row, mine, n, skip in zip(kv, out, lens, skips):
            if slot_mapping is not None and not skip:
                whole.append(mine)
                continue
            first = 0 if sig.reset else row.kv_len
            at = torch.arange(first - skip, first + n)
            slots = torch.tensor(row.pages, dtype=torch.long)[at // cache.page_size] * cache.page_size \
                + at % cache.page_size
            if n and slot_mapping is None:
                cache.write_rows(name, slots[skip:], mine)
            whole.append(torch.cat([cache.read_rows(name, slots[:skip]).to(mine.dtype), mine]) if skip else mine)
        values[value] = whole


def named_outputs(out: Any, sig: Mode, writes: dict[str, str], label: str) -> dict[str, Any]:
    """What a plain mode returned (a tensor when it has one output, else a
    dict by signature name), by walk value."""
    if not isinstance(out, Mapping):
        if len(sig.outputs) != 1:
            raise RuntimeError(f"{label} returned one tensor; its signature has {[o.name for o in sig.outputs]}")
        out = {sig.outputs[0].name: out}
    missing = [n for n in writes if n not in out]
    if missing:
        raise RuntimeError(f"{label} returned {sorted(out)}, not {missing}")
    return {value: out[name] for name, value in writes.items()}


def host_id_rows(items: list[WorkItem], names: list[list[str]]) -> dict[str, tuple[torch.Tensor, ...]]:
    """The inputs that are, in every row, a stream chunk of token ids held on
    the host, all of one length (a codec's windows): made into one tensor in
    one call, each row's a view of it, by name."""
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    if len(items) < 2 or any(item.payload.held for item in items):
        return out
    for name in names[0]:
        chunks = [item.payload.inputs.get(name) for item in items]
        first = chunks[0]
        if not isinstance(first, list) or not first:
            continue
        if any(not isinstance(c, list) or len(c) != len(first) for c in chunks):
            continue
        try:  # a chunk holding a stored item (a TensorRef) is not made of ids: each row's own way
            # numpy builds it from nested lists of ints ~3x faster than torch.tensor
            out[name] = torch.from_numpy(np.array(chunks, dtype=np.int64)).unbind(0)
        except (TypeError, ValueError, OverflowError):
            continue
    return out


def state_rows(pool: StatePool | None, slots: list[int | None] | torch.Tensor,
               device: torch.device) -> StateRows | None:
    """The rows' slots of the component's per-row state (None without one)."""
    if pool is None:
        return None
    if not isinstance(slots, torch.Tensor):
        assert all(s is not None for s in slots), "a row of a component with state has no slot"
        slots = torch.tensor(slots, dtype=torch.long)
    return StateRows(pool.tensors, to_device(slots, device), host=slots.tolist())
