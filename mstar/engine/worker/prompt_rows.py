"""Which new rows' prompts may run in chunks and start from the prefix
cache, and the keys of their prompts' pages: the walker asks here as it
queues a row's first KV step.

Only steps whose KV depends on nothing but their token ids from position 0
qualify: a sampling component's name-only token steps (one token out per
row, so computing the prompt in parts, or fewer of its tokens, changes no
output), on a component without per-row state (a prefix of KV would leave it
empty) and no mode of which restarts its cache in place (that would write
over shared pages). Signed modes (embeddings, media, M-RoPE positions) run
whole and are not reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import StreamItem
from mstar.graph import Component, Step
from mstar.scheduler.prefix_cache import page_keys


@dataclass(frozen=True, slots=True)
class PromptRow:
    """What the scheduler may do with a row's first step."""

    chunkable: bool = False        # it may run over several steps, a chunk of its tokens each
    prefix: tuple[bytes, ...] = ()  # the keys of its prompt's full pages, for the prefix cache


def prompt_row(store: TensorStore, comp: Component | None, step: Step,
               inputs: dict[str, TensorRef | list[StreamItem] | int], row: KVRow, page_size: int,
               caching: bool) -> PromptRow:
    """How `step`, the first of `row`, may be scheduled (`caching`: its
    component has a prefix cache)."""
    if row.pages or row.kv_len or row.swapped is not None or row.branch != "main":
        return PromptRow()
    if comp is None or not comp.samples or comp.state or step.mode in comp.signatures:
        return PromptRow()
    if any(mode.reset for mode in comp.signatures.values()):
        return PromptRow()
    ref = inputs.get(step.inputs[0])
    if not isinstance(ref, TensorRef):
        return PromptRow()
    ids = store.get(ref)
    if ids.is_floating_point():
        return PromptRow()
    keys = page_keys(ids.reshape(-1).tolist(), page_size, salt=step.component.encode()) if caching else ()
    return PromptRow(chunkable=True, prefix=keys)
