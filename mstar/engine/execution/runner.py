"""Runs one batch of one (component, mode) on a device: prepare inputs →
forward → sample. Rows come in as scheduler items carrying tensor handles;
what each row wrote goes out as one batch tensor per value.

Two kinds of components: a KV component takes token ids, appends them to each
row's paged KV cache and (when it samples) returns one token per row; any
other component takes its inputs stacked over rows and returns named tensors.
A mode that declares a signature gets its inputs by signature name and names
its outputs the same way (`pack.py`); a name-only mode takes them by position.
A KV component's decode groups step through the runner too, by its
`GroupSteps` (`group_steps.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mstar.engine.execution.backends import AttentionBackend
from mstar.engine.execution.graphs.cuda_graphs import DecodeGraphs
from mstar.engine.execution.draws import Draws
from mstar.engine.execution.graphs.kv_mode_graphs import KVModeGraphs
from mstar.engine.execution.group_steps import GroupLaunch, GroupSteps
from mstar.engine.execution.mixed import NewRows
from mstar.engine.execution.graphs.mixed_graphs import MixedGraphs
from mstar.engine.memory.kv_cache import KVCache
from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.execution.graphs.mode_graphs import ModeGraphs, takes_seeds
from mstar.engine.execution.pack import (host_id_rows, kv_outputs, pack_kv, page_token_rows, state_rows,
                                         step_indices)
from mstar.engine.execution.plain_steps import PlainSteps, step_outputs
from mstar.engine.execution.row_sampler import DeviceClock, RowSampler
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import PartitionRun
from mstar.engine.execution.sampler import SamplingTensors
from mstar.engine.execution.graphs.sampler_graphs import SamplerGraphs
from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.graph import Component, Kind, Mode, Step, step_bindings
from mstar.scheduler import Batch, WorkItem
from mstar.engine.memory.state_slots import StatePool
from mstar.types import AttentionContext, TokenBatch


@dataclass(eq=False)
class StepOutput:
    """Per value written by the step: one tensor whose row i belongs to row i."""

    parts: list[PartitionRun]
    values: dict[str, torch.Tensor | list[torch.Tensor]]
    logprobs: torch.Tensor | None = None  # of a sampling step's tokens, packed (`sampler.token_logprobs`), on the host
    sampled: tuple[str, ...] | None = None  # the values that are sampled tokens; None: all, if the component samples
    branches: list[str] | None = None       # the branch row each row stepped (after a fork); None: all "main"


class ComponentRunner:
    def __init__(self, name: str, spec: Component, module: nn.Module, device: torch.device,
                 store: TensorStore, kv: KVCache | None, attention: AttentionBackend | None = None,
                 graphs: DecodeGraphs | None = None, mode_graphs: dict[str, ModeGraphs] | None = None,
                 state: StatePool | None = None, kv_graphs: dict[str, KVModeGraphs] | None = None,
                 mixed_graphs: MixedGraphs | None = None, sampler_graphs: SamplerGraphs | None = None) -> None:
        """`graphs`: the decode graphs of token loop groups; `mode_graphs`:
        plain modes' graphs; `kv_graphs`: graphs of KV modes with a signature;
        `mixed_graphs`: graphs of mixed steps; `sampler_graphs`: graphs of the
        decode graphs' draws (each where captured)."""
        self.name = name
        self.spec = spec
        self.module = module
        self.device = device
        self.store = store
        self.kv = kv
        self.state = state
        self.attention = attention
        self.mode_graphs = mode_graphs or {}
        self.clock = DeviceClock(device)
        # the group steps and the sampler own the graphs and the head's window; the runner reads theirs
        self.sampler = RowSampler(self.clock, getattr(module, "vocab_window", None), sampler_graphs)
        self.groups = GroupSteps(module, device, attention, graphs, kv_graphs or {}, mixed_graphs, state,
                                 self.clock, self.sampler)
        self._takes_seeds: dict[str, bool] = {}  # by mode
        self.plain = PlainSteps(self.mode_graphs, device)
        # `Component.own_stream`: the steps' work is queued here, beside the worker's stream
        self.stream = (torch.cuda.Stream(device, priority=-1 if spec.urgent else 0)
                       if device.type == "cuda" and spec.own_stream else None)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode graphs of token loop groups, where captured."""
        return self.groups.graphs

    @property
    def kv_graphs(self) -> dict[str, KVModeGraphs]:
        return self.groups.kv_graphs

    @property
    def mixed_graphs(self) -> MixedGraphs | None:
        return self.groups.mixed_graphs

    @property
    def vocab_window(self) -> tuple[int, int] | None:
        """The ids the head computes logits of (`VocabHead.restrict`); None: all."""
        return self.sampler.vocab_window

    @property
    def device_s(self) -> float:
        """The device time of the last step, item or group."""
        return self.clock.seconds

    @property
    def mixed_replayed(self) -> bool:
        """The last mixed step replayed a graph."""
        return self.groups.mixed_replayed

    def take_inputs(self, batch: Batch) -> list[dict[str, torch.Tensor]]:
        """Each row's inputs, read out of the store (its references dropped):
        a batch that fails in `compute` can run again row by row from these.
        A row whose earlier chunk took them has them in its payload."""
        if batch.mode in self.spec.signatures:  # every bound input, of each row's own step
            names = [list(item.payload.inputs) for item in batch.items]
        else:  # each row's own step: rows of two walks may bind other names
            names = [list(item.payload.part.current_step().inputs) for item in batch.items]
            if self.kv is not None:
                names = [n[:1] for n in names]
        ids = host_id_rows(batch.items, names)
        return [item.payload.held or {n: ids[n][i] if n in ids else self._take(item, n) for n in row}
                for i, (item, row) in enumerate(zip(batch.items, names))]

    def by_writes(self, batch: Batch) -> list[list[WorkItem]]:
        """The batch's rows by the walk values their step writes (a chat's
        prefill keeps only its token, a spoken chat's also the talker's rows):
        one call each way."""
        sig = self.spec.signatures.get(batch.mode)
        if sig is None or len({id(item.payload.part.current_step()) for item in batch.items}) == 1:
            return [batch.items]  # rows of one walk's step (the usual case): one way
        groups: dict[tuple, list[WorkItem]] = {}
        for item in batch.items:
            writes = step_bindings(item.payload.part.current_step(), sig)[1]
            groups.setdefault(tuple(sorted(writes.items())), []).append(item)
        return list(groups.values())

    @torch.inference_mode()
    def compute(self, batch: Batch, inputs: list[dict[str, torch.Tensor]]) -> StepOutput:
        """Forward (and sample) the rows on `inputs`. A row's state moves on
        only once the whole step has succeeded, so a failed step can be run
        again."""
        parts = [item.payload.part for item in batch.items]
        branches = [item.payload.branch for item in batch.items]
        step = parts[0].current_step()
        self.clock.reset()
        fn = self.clock.timed(getattr(self.module, batch.mode))
        logprobs = None
        sig = self.spec.signatures.get(batch.mode)
        banned = [item.payload.banned for item in batch.items]
        if self.kv is not None and sig is not None:
            return self._run_signed(inputs, parts, branches, sig, fn, banned, [item.done for item in batch.items])
        if any(p.current_step() is not step and p.current_step() != step for p in parts[1:]):
            # one call names its values after one step: the row-by-row retry runs each row's own
            raise RuntimeError(f"rows of one {step.label} step read or write different values")
        if self.kv is not None:
            spans = [(item.done, item.done + item.chunk if item.chunkable else None) for item in batch.items]
            values, logprobs, ends = self._run_tokens([row[step.inputs[0]] for row in inputs], parts, branches,
                                                      step, fn, banned, spans)
            if len(ends) < len(parts):  # rows with chunks to come write nothing yet
                parts, branches = [parts[i] for i in ends], [branches[i] for i in ends]
        else:
            seeds = self._row_seeds(parts, step) if self._seeded(batch.mode) else None
            if self.state is not None:  # the rows' slots, as the keyword `state`
                rows = [p.row(self.name, b) for p, b in zip(parts, branches)]
                state = state_rows(self.state, [r.slot for r in rows], self.device)
                assert state is not None
                state.new = [r.slot_new for r in rows]
                fn = functools.partial(fn, state=state)
            values = (self.plain.run(inputs, step, fn, seeds) if sig is None
                      else self.plain.run_signed(inputs, step, sig, fn, seeds, self.state is not None))
            if self.state is not None:
                for p, b in zip(parts, branches):
                    p.row(self.name, b).stepped_on_slot()
        return StepOutput(parts, values, logprobs, branches=branches)

    def _seeded(self, mode: str) -> bool:
        if mode not in self._takes_seeds:
            self._takes_seeds[mode] = takes_seeds(getattr(self.module, mode))
        return self._takes_seeds[mode]

    def _row_seeds(self, parts: list[PartitionRun], step: Step) -> torch.Tensor:
        """One seed per row from its request's seed and how many times the row
        has run this step: a row's draws do not depend on its batch."""
        value = step.outputs[0]
        seeds = [(p.seed_of(step) * 1_000_003 + p.writes.get(value, 0)) % 2**63 for p in parts]
        return torch.tensor(seeds, dtype=torch.long)  # on the host: a graph stages it, an eager call moves it

    # ------------------------------------------------------------ KV rows

    def _run_tokens(self, rows: list[torch.Tensor], parts: list[PartitionRun], branches: list[str], step: Step,
                    fn, banned: list[tuple[int, ...]], spans: list[tuple[int, int | None]]
                    ) -> tuple[dict, torch.Tensor | None, list[int]]:
        """`spans`: the tokens of each row this step computes, [start, end)
        (end None: to the last). Those before `start` are in its pages already
        (a prefix cache hit, or earlier chunks); a row that ends before its
        last token (a chunk) samples nothing, and the values hold the others':
        the rows whose prompt ended, returned last."""
        assert self.kv is not None and self.attention is not None
        kv = [p.row(self.name, b) for p, b in zip(parts, branches)]
        ends = [i for i, (row, (_, end)) in enumerate(zip(rows, spans)) if end is None or end >= row.numel()]
        lens = [(row.numel() if end is None else end) - start for row, (start, end) in zip(rows, spans)]
        logits = None   # a lone short prompt replays a mixed graph: eagerly it is a launch-bound forward
        if self.mixed_graphs is not None and self.spec.samples and step.mode not in self.spec.apart:
            prompts = [row.reshape(-1) for row in rows]
            with torch.profiler.record_function("mstar.replay"):
                logits = self.mixed_graphs.run_prompts(NewRows(parts, kv, prompts, [
                    (start, start + n) for (start, _), n in zip(spans, lens)], banned))
            if logits is not None:
                self.clock.seconds += self.mixed_graphs.fence.wait_s
        if logits is None:
            positions = [torch.arange(r.kv_len, r.kv_len + n) for r, n in zip(kv, lens)]
            query_start = torch.zeros(len(rows) + 1, dtype=torch.long)
            query_start[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
            input_ids, flat_positions, logits_index, _ = step_indices(
                [row.reshape(-1)[start:end] for row, (start, end) in zip(rows, spans)], torch.cat(positions),
                query_start, self.device)
            attn = self.attention.plan(query_start, torch.tensor([r.kv_len for r in kv], dtype=torch.long),
                                       [r.pages for r in kv])
            batch = TokenBatch(input_ids=input_ids, positions=flat_positions, query_start=query_start,
                               logits_index=logits_index, attn=attn,
                               state=state_rows(self.state, [r.slot for r in kv], self.device))
            with torch.profiler.record_function("mstar.forward"):
                out = fn(batch)
            if self.spec.samples:
                logits = out["logits"] if len(ends) == len(rows) else out["logits"][ends]
        if logits is not None:  # a repetition penalty sees the whole prompt, however it was computed
            tokens, logprobs = self.sampler.rows(logits, [parts[i] for i in ends], [kv[i] for i in ends],
                                                 [rows[i].reshape(-1) for i in ends], [banned[i] for i in ends])
            values = {step.outputs[0]: tokens}
        else:
            values, logprobs = step_outputs(step, out), None
        ended = set(ends)
        for i, (r, n) in enumerate(zip(kv, lens)):  # only now: a step that raised left its rows as they were
            r.advance(n, None, self.spec.samples and i in ended)
        return values, logprobs, ends

    def _run_signed(self, inputs: list[dict[str, torch.Tensor]], parts: list[PartitionRun], branches: list[str],
                    sig: Mode, fn: Callable, banned: list[tuple[int, ...]], skips: list[int]) -> StepOutput:
        """A KV step of a mode with a signature: every bound input packed by
        name (`pack_kv`; `skips`: each row's first tokens that a prefix cache
        hit put in its pages already), the TOKEN output sampled from the
        mode's "logits", the others named by the binding."""
        assert self.kv is not None and self.attention is not None
        steps = [p.current_step() for p in parts]
        bound = [step_bindings(s, sig) for s in steps]
        reads = [r for r, _ in bound]
        writes = bound[0][1]
        if any(w != writes for _, w in bound[1:]):  # the rows then run alone, each named by its own step
            raise RuntimeError(f"rows of one {steps[0].label} step write different values")
        rows = [{name: row[value] for name, value in r.items()} for row, r in zip(inputs, reads)]
        kv = [p.row(self.name, b) for p, b in zip(parts, branches)]
        # a mode may be another's step once the module reduced its inputs on the host (a talker reading a script)
        alias = getattr(self.module, "graph_aliases", {}).get(sig.name)
        graphs = self.kv_graphs.get(alias or sig.name)
        if graphs is not None and (self.state is not None or not graphs.fits(len(rows))
                                   or any(row[sig.query].numel() != 1 for row in rows)):
            graphs = None
        plans: list[tuple] = []

        def plan(*args) -> AttentionContext | None:  # a replay plans its bucket's metadata itself
            plans.append(args)
            return None if graphs is not None else self.attention.plan(*args)
        packed = pack_kv(rows, reads, kv, sig, self.spec.position_axes, plan, self.device, skips)
        packed.batch.state = state_rows(self.state, [r.slot for r in kv], self.device)
        draws = steps[0].draws
        if draws is not None:
            packed.batch.draw = self._drawer(parts, kv, draws, sig.draws)
        out = None
        if graphs is not None:
            with torch.profiler.record_function("mstar.replay"):
                batch = self.module.as_graph_step(sig.name, packed.batch) if alias else packed.batch
                out = graphs.run(batch, plans[0][1], plans[0][2], packed.batch.draw)  # its lengths and pages
            if out is None:
                packed.batch.attn = self.attention.plan(*plans[0])
        if out is None:
            with torch.profiler.record_function("mstar.forward"):
                out = fn(packed.batch)
        token = next((o.name for o in sig.outputs if o.kind is Kind.TOKEN and o.name in writes), None)
        tokens = logprobs = None
        if token is not None:
            if "logits" not in out:
                raise RuntimeError(f"{steps[0].label} returned {sorted(out)}: no 'logits' to sample '{token}' from")
            tokens, logprobs = self.sampler.rows(out["logits"], parts, kv, packed.ids, banned)
        values = kv_outputs(out, sig, writes, packed.lens, tokens, steps[0].label)
        if self.kv.rows:
            attn = packed.batch.attn
            page_token_rows(values, self.kv, sig, writes, kv, packed.lens, skips,
                            getattr(attn, "slot_mapping", None) if attn is not None else None)
        for r, n, delta in zip(kv, packed.lens, packed.rope_deltas):  # only now, as in `_run_tokens`
            if sig.kv == "append":
                r.advance(n, delta, tokens is not None, reset=sig.reset)
            elif tokens is not None:
                r.advance(0, None, True)
            if draws is not None:
                r.drew(draws, sig.draws)
        return StepOutput(parts, values, logprobs, sampled=(writes[token],) if token is not None else (),
                          branches=branches)

    def _drawer(self, parts: list[PartitionRun], kv: list[KVRow], key: str, count: int) -> Draws:
        """`TokenBatch.draw` for a mode's `count` own draws under sampling key
        `key`, from each row's counter for the key."""
        params = [p.request.sampling[key] for p in parts]
        st = SamplingTensors.build(params, [p.seed for p in params], [r.drawn.get(key, 0) for r in kv], self.device)
        return Draws(st, count)

    @torch.inference_mode()
    def run_group(self, group: LoopGroup, sl: slice, fed: list[int] | None = None,
                  new: NewRows | None = None) -> GroupLaunch:
        """Launch one decode step of rows `sl` of a token loop group (with
        `new`: and those new rows' prompt chunks, a mixed step). `fed`: each
        row's stream item, where the step reads one."""
        assert self.kv is not None
        return self.groups.run(group, sl, fed, new)

    def _take(self, item: WorkItem, name: str) -> torch.Tensor:
        ref = item.payload.inputs[name]
        if isinstance(ref, int):  # a built-in value (`@i`, `@chunk`), held on the host
            return torch.tensor(ref, dtype=torch.long)
        if isinstance(ref, list):  # a stream chunk: items of the stream, in order
            if all(isinstance(r, int) for r in ref):  # token ids held on the host: one tensor, no device reads
                return torch.tensor(ref, dtype=torch.long)
            if any(isinstance(r, int) for r in ref):  # token ids, some still stored: read those (a wait)
                return torch.tensor([r if isinstance(r, int) else int(self.store.take(r, item.request_id))
                                     for r in ref], dtype=torch.long)
            return torch.stack([self._stored(r, item.request_id) for r in ref])
        assert isinstance(ref, TensorRef)
        return self._stored(ref, item.request_id)

    def _stored(self, ref: TensorRef, owner: str) -> torch.Tensor:
        """`ref`'s tensor, its reference dropped. On a stream of the
        component's own, the memory (the worker's stream made it) is kept
        from reuse until this stream has read it: the store may have held
        the last reference."""
        t = self.store.take(ref, owner)
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)
        return t
