"""What a Submit's first step computes once per request, done without the
slower paths it replaced: page keys hashed from a tensor's bytes are the
keys of its ids as ints, a prompt's ids are read to a list only for a row
that follows them, and a loop's value writer is found once per loop."""

from __future__ import annotations

import hashlib
from array import array

import pytest
import torch

from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.worker.kv_rows import KVRow
from mstar.engine.worker.prompt_rows import PromptRow, prompt_row
from mstar.graph import Component, Loop, Step
from mstar.scheduler.prefix_cache import page_keys, page_keys_of


def _reference_keys(ids: list[int], page_size: int, salt: bytes = b"", columns: tuple = ()) -> tuple[bytes, ...]:
    """The chain as first written (a page's ints converted on their own):
    the keys must not change with how they are computed."""
    keys, parent = [], salt
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", ids[start:start + page_size]).tobytes())
        for column in columns:
            h.update(array("q", column[start:start + page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


@pytest.mark.parametrize("n", [0, 3, 15, 16, 17, 32, 47, 130])
def test_keys_from_bytes_are_the_keys_of_the_ints(n: int) -> None:
    ids = torch.randint(-5, 200_000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    cols = [[i * 3 for i in range(n)], [-i for i in range(n)]]
    want = _reference_keys(ids, 16, b"llm", tuple(cols))
    assert page_keys(ids, 16, salt=b"llm", columns=cols) == want
    data = array("q", ids).tobytes()
    assert page_keys_of(data, 16, b"llm", [array("q", c).tobytes() for c in cols]) == want
    assert page_keys_of(data, 16) == _reference_keys(ids, 16) == page_keys(ids, 16)


def _prompt(ids: torch.Tensor) -> PromptRow:
    store = TensorStore()
    ref = TensorRef(store.put(ids, ("r",)))
    comp = Component(modes=("prefill",), kv_cache=True, samples=True)
    step = Step("llm", "prefill", ("ids",), ("token",))
    return prompt_row(store, comp, step, {"ids": ref}, KVRow("llm"), 16, caching=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_prompts_keys_and_ids_whatever_its_shape_and_dtype(dtype: torch.dtype) -> None:
    ids = torch.arange(1000, 1040, dtype=dtype).reshape(1, 40)
    row = _prompt(ids.t().contiguous().t())  # not contiguous: its flat order is still the ids'
    flat = list(range(1000, 1040))
    assert row.chunkable and row.prefix == _reference_keys(flat, 16, b"llm")
    assert row.ids() == flat and PromptRow().ids() == []


def test_a_loops_writer_is_the_body_step_writing_its_value() -> None:
    first = Step("llm", "decode", ("token",), ("token",))
    assert Loop(step=first).writer is first
    later = Step("codec", "window", ("code",), ("code",))
    assert Loop((Step("llm", "x", ("code",), ("h",)), later), value="code").writer is later
    assert Loop((Loop(step=first),), value="token").writer is None  # a nested loop writes it
