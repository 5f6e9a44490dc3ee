"""mstar/engine/movement/transport.py between two CUDA devices: copies equal their
source (dtypes, sizes, non-contiguous layouts), receive() never waits on the
host, and the copy is ordered after the producer's event."""

from __future__ import annotations

import time

import pytest
import torch

from mstar.engine.movement.transport import Transport, is_done

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs torch.cuda.device_count() >= 2 (found {torch.cuda.device_count()})")

SRC, DST = torch.device("cuda", 0), torch.device("cuda", 1)
BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep spins this many GPU clocks: about a second at H200 clocks


@pytest.fixture(scope="module")
def transport() -> Transport:
    t = Transport(DST)
    t.enable_peer(SRC)
    return t


def busy(device: torch.device) -> None:
    """Keep `device`'s current stream busy for a while (nothing else queued on the host)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(BUSY_CYCLES)


def sample(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=SRC).manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, device=SRC, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(n, device=SRC, generator=g).to(dtype)
    return torch.randint(0, 120, (n,), device=SRC, generator=g).to(dtype)


def check(got: torch.Tensor, src: torch.Tensor) -> None:
    torch.cuda.synchronize(SRC)
    torch.cuda.synchronize(DST)
    assert got.device == DST and got.dtype == src.dtype and got.shape == src.shape
    assert torch.equal(got.cpu(), src.cpu())


def test_transport_reports_its_streams_and_peers(transport: Transport) -> None:
    assert transport.device == DST
    assert transport.stream is not None and transport.stream.device == DST
    assert set(transport.peer_access) == set(range(torch.cuda.device_count())) - {1}
    assert transport.peer_access[0] == torch.cuda.can_device_access_peer(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8,
                                   torch.bool])
@pytest.mark.parametrize("n", [1, 4097, 1 << 20])
def test_copies_equal_the_source(transport: Transport, dtype: torch.dtype, n: int) -> None:
    src = sample(n, dtype)
    ready = torch.cuda.current_stream(SRC).record_event()
    got = transport.receive(src, ready)
    assert got.done is not None
    check(got.tensor, src)
    assert is_done(got)


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "sliced_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_non_contiguous_sources(transport: Transport, layout: str, dtype: torch.dtype) -> None:
    base = sample(64 * 48, dtype).view(64, 48)
    src = {"transposed": base.t(), "strided": base[:, ::3], "expanded": base[:1].expand(5, 48),
           "sliced_rows": base[10:20]}[layout]
    got = transport.receive(src, torch.cuda.current_stream(SRC).record_event())
    check(got.tensor, src)


def test_receive_does_not_wait_on_the_host(transport: Transport) -> None:
    transport.receive(torch.ones(8, device=SRC), None)  # warm: streams exist, peer access is on
    torch.cuda.synchronize(SRC)
    torch.cuda.synchronize(DST)
    src = torch.zeros(1 << 20, device=SRC)
    busy(SRC)
    src.fill_(3.0)
    ready = torch.cuda.current_stream(SRC).record_event()
    t0 = time.perf_counter()
    got = transport.receive(src, ready)
    returned_s = time.perf_counter() - t0
    # the producer is still busy, so a receive() that waited for it could not have returned yet
    assert not ready.query(), "the producer's kernel finished before receive() returned: raise BUSY_CYCLES"
    assert not is_done(got)
    assert returned_s < 0.25
    got.done.synchronize()
    assert torch.equal(got.tensor.cpu(), torch.full((1 << 20,), 3.0))


def test_copy_sees_what_the_producer_wrote_before_its_event(transport: Transport) -> None:
    src = torch.zeros(4 << 20, device=SRC)
    producer = torch.cuda.Stream(device=SRC)   # not the current stream: only `ready` orders the copy
    producer.wait_stream(torch.cuda.current_stream(SRC))  # after the zeros
    with torch.cuda.stream(producer):
        busy(SRC)
        src.add_(7.0)
        ready = producer.record_event()
    got = transport.receive(src, ready)
    # the consumer uses it at once on its current stream: ordered by the GPU, not by the host
    doubled = got.tensor * 2
    assert torch.equal(doubled.cpu(), torch.full((4 << 20,), 14.0))


def test_without_an_event_the_copy_follows_the_current_stream(transport: Transport) -> None:
    src = torch.zeros(1 << 16, dtype=torch.int32, device=SRC)
    busy(SRC)
    src.fill_(11)
    got = transport.receive(src, None)
    assert torch.equal(got.tensor.cpu(), torch.full((1 << 16,), 11, dtype=torch.int32))


def test_source_may_be_dropped_right_away(transport: Transport) -> None:
    src = torch.zeros(1 << 20, device=SRC)
    busy(SRC)
    src.fill_(5.0)
    got = transport.receive(src, torch.cuda.current_stream(SRC).record_event())
    ptr = src.data_ptr()
    del src
    # the copy has not run (the producer is busy): the allocator must not hand src's memory out again
    junk = torch.empty(1 << 20, device=SRC)
    assert junk.data_ptr() != ptr
    junk.fill_(-1.0)
    assert torch.equal(got.tensor.cpu(), torch.full((1 << 20,), 5.0))


def test_same_device_is_returned_as_is(transport: Transport) -> None:
    x = torch.arange(10, device=DST)
    got = transport.receive(x, torch.cuda.current_stream(DST).record_event())
    assert got.tensor is x and got.done is None


def test_host_to_device_and_back(transport: Transport) -> None:
    host = torch.randn(1000, 3).t()  # pageable and non-contiguous
    up = transport.receive(host, None)
    assert up.tensor.device == DST and up.done is not None
    assert torch.equal(up.tensor.cpu(), host)
    src = sample(5000, torch.float16)
    down = Transport("cpu").receive(src, torch.cuda.current_stream(SRC).record_event())
    assert down.tensor.device.type == "cpu" and down.tensor.is_pinned() and down.done is not None
    down.done.synchronize()  # callers wait before reading host memory
    assert torch.equal(down.tensor, src.cpu())
