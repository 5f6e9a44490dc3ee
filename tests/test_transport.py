"""mstar/engine/movement/transport.py on the CPU: what needs no copy comes back as it
is, values untouched, and `is_done` (the CUDA paths: test_transport_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.movement.transport import Received, Transport, is_done


def test_cpu_transport_has_no_streams() -> None:
    t = Transport(torch.device("cpu"))
    assert t.device == torch.device("cpu")
    assert t.stream is None and t.peer_access == {}
    assert t.enable_peer(0) is False


@pytest.mark.parametrize("src", [
    torch.arange(10, dtype=torch.float32),
    torch.randn(4, 6).t(),                            # non-contiguous
    torch.arange(20, dtype=torch.int64)[::3],        # strided
    torch.tensor([True, False, True]),
    torch.empty(0, 3, dtype=torch.bfloat16),
])
def test_cpu_to_cpu_is_the_same_tensor(src: torch.Tensor) -> None:
    before, stride = src.clone(), src.stride()
    got = Transport("cpu").receive(src, None)
    assert isinstance(got, Received)
    assert got.tensor is src and got.done is None
    assert torch.equal(got.tensor, before) and got.tensor.stride() == stride
    assert is_done(got) and Transport.is_done(got)


def test_values_unchanged_across_many_receives() -> None:
    t = Transport("cpu")
    src = torch.randn(1000, dtype=torch.float64)
    before = src.clone()
    for _ in range(10):
        assert torch.equal(t.receive(src, None).tensor, before)


def test_is_done_asks_the_event() -> None:
    class Pending:
        def __init__(self) -> None:
            self.finished = False

        def query(self) -> bool:
            return self.finished

    ev = Pending()
    r = Received(torch.zeros(1), ev)  # type: ignore[arg-type]  (any object with query() stands in for an event)
    assert not is_done(r)
    ev.finished = True
    assert is_done(r)
    assert is_done(Received(torch.zeros(1)))


def test_unsupported_pair_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot receive"):
        Transport("meta").receive(torch.zeros(2), None)
