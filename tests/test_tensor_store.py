"""The tensor store: handles, per-request references, teardown."""

from __future__ import annotations

import threading

import pytest
import torch

from mstar.engine.movement.tensor_store import TensorRef, TensorStore


def test_a_batch_tensor_lives_until_its_last_row_is_taken() -> None:
    store = TensorStore()
    h = store.put(torch.arange(3), ["a", "b", "c"])
    assert store.take(TensorRef(h, 1), "b").item() == 1
    assert store.take(TensorRef(h, 0), "a").item() == 0
    assert len(store) == 1
    assert store.take(TensorRef(h, 2), "c").item() == 2
    assert len(store) == 0 and store.num_owners() == 0


def test_taking_a_reference_that_is_not_held_fails() -> None:
    store = TensorStore()
    h = store.put(torch.zeros(2), ["a"])
    with pytest.raises(KeyError):
        store.take(TensorRef(h, 0), "b")


def test_drop_owner_frees_only_what_nobody_else_holds() -> None:
    store = TensorStore()
    shared = store.put(torch.zeros(2), ["a", "b"])
    own = store.put(torch.ones(2), ["a", "a"])
    store.retain(TensorRef(shared), "a", 2)
    assert store.drop_owner("a") == 2
    assert len(store) == 1
    assert store.get(TensorRef(shared, 0)).item() == 0
    store.release(TensorRef(shared), "b")
    assert len(store) == 0 and store.num_owners() == 0
    del own


def test_concurrent_puts_and_takes_balance() -> None:
    store = TensorStore()

    def work(owner: str) -> None:
        for i in range(500):
            h = store.put(torch.tensor([i]), [owner])
            store.take(TensorRef(h, 0), owner)

    threads = [threading.Thread(target=work, args=(f"o{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 0 and store.num_owners() == 0
