"""Which new rows may start from the prefix cache, and the keys of their
prompts' pages: the walker asks here as it queues a row's first KV step.

Only steps whose KV depends on nothing but their token ids from position 0
qualify: a sampling component's name-only token steps (one token out per
row, so computing fewer prompt tokens changes no output), on a component no
mode of which restarts its cache in place (that would overwrite shared
pages). Signed modes (embeddings, media, M-RoPE positions) are not reused.
"""

from __future__ import annotations

from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.rows import StreamItem
from mstar.graph import Component, Step
from mstar.scheduler.prefix_cache import page_keys


def prefix_keys(store: TensorStore, comp: Component | None, step: Step,
                inputs: dict[str, TensorRef | list[StreamItem] | int], row: KVRow,
                page_size: int) -> tuple[bytes, ...]:
    """The keys of the full pages of the prompt that `step` starts `row`
    with, or () where its KV may not come from the cache."""
    if row.pages or row.kv_len or row.swapped is not None or row.branch != "main":
        return ()
    if comp is None or not comp.samples or comp.state or step.mode in comp.signatures:
        return ()  # a recurrent state is no page: a prefix of KV alone would leave it empty
    if any(mode.reset for mode in comp.signatures.values()):
        return ()
    ref = inputs.get(step.inputs[0])
    if not isinstance(ref, TensorRef):
        return ()
    ids = store.get(ref)
    if ids.is_floating_point() or ids.numel() < page_size:
        return ()
    return page_keys(ids, page_size, salt=step.component.encode())
