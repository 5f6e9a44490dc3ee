"""The host arena (mstar/engine/movement/arena.py): size classes, reuse, exhaustion,
alignment, concurrent alloc/release, another process seeing the region, and
staging rows to the host."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import uuid

import arena_child
import pytest
import torch

from mstar.engine.movement.arena import (
    ALIGNMENT,
    MAX_BLOCK,
    MIN_BLOCK,
    HostArena,
    attach,
    size_class,
    stage_to_host,
)

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def arena():
    with HostArena(4 * MiB) as a:
        yield a


def test_size_classes() -> None:
    assert size_class(0) == MIN_BLOCK == 4 * KiB
    assert size_class(1) == 4 * KiB
    assert size_class(4 * KiB) == 4 * KiB
    assert size_class(4 * KiB + 1) == 8 * KiB
    assert size_class(MiB - 1) == MiB
    assert size_class(MiB + 1) == 2 * MiB


def test_block_size_follows_the_class(arena: HostArena) -> None:
    small = arena.alloc((10,), torch.float32)                      # 40 bytes -> 4 KiB
    mid = arena.alloc((1025,), torch.float32)                      # 4100 bytes -> 8 KiB
    big = arena.alloc((3, 100_000), torch.uint8)                   # 300 000 bytes -> 512 KiB
    assert (small.size, mid.size, big.size) == (4 * KiB, 8 * KiB, 512 * KiB)
    assert arena.in_use_bytes == small.size + mid.size + big.size
    assert arena.blocks_in_use == 3
    for b in (small, mid, big):
        b.release()
    assert arena.in_use_bytes == 0 and arena.blocks_in_use == 0


def test_release_then_alloc_gives_the_same_block_back(arena: HostArena) -> None:
    a = arena.alloc((100,), torch.float32)
    b = arena.alloc((100,), torch.float32)
    assert a.offset != b.offset
    a.release()
    c = arena.alloc((50,), torch.int64)  # same class (4 KiB): the freed block, not fresh space
    assert c.offset == a.offset
    # a bigger class does not take it
    d = arena.alloc((5000,), torch.float32)
    assert d.offset not in (a.offset, b.offset)
    for blk in (b, c, d):
        blk.release()


def test_release_is_idempotent(arena: HostArena) -> None:
    a = arena.alloc((8,), torch.float32)
    a.release()
    a.release()
    assert a.released
    assert arena.blocks_in_use == 0 and arena.in_use_bytes == 0
    # released twice but on the free list once: two allocations get two different blocks
    x, y = arena.alloc((8,), torch.float32), arena.alloc((8,), torch.float32)
    assert x.offset != y.offset
    assert a.offset in (x.offset, y.offset)
    x.release()
    y.release()


def test_views_are_aligned(arena: HostArena) -> None:
    blocks = [arena.alloc(shape, dtype) for shape, dtype in [
        ((1,), torch.uint8), ((3,), torch.float64), ((7, 3), torch.bfloat16), ((5000,), torch.int32),
        ((2, 2, 2), torch.complex64), ((1,), torch.bool)]]
    for b in blocks:
        assert b.tensor.data_ptr() % ALIGNMENT == 0
        assert b.offset % MIN_BLOCK == 0
        assert b.tensor.data_ptr() == arena.tensor.data_ptr() + b.offset
        b.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int16,
                                   torch.bool, torch.complex64, torch.uint8])
def test_views_of_different_dtypes(arena: HostArena, dtype: torch.dtype) -> None:
    shape = (3, 17, 5)
    b = arena.alloc(shape, dtype)
    assert b.tensor.shape == shape and b.tensor.dtype == dtype and b.tensor.is_contiguous()
    values = (torch.randn(shape) * 50).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    b.tensor.copy_(values)
    # the bytes really are in the region, where the block says
    raw = arena.tensor[b.offset:b.offset + values.numel() * dtype.itemsize]
    assert torch.equal(raw.view(dtype).view(shape), values)
    b.release()


def test_zero_element_tensor(arena: HostArena) -> None:
    b = arena.alloc((0, 4), torch.float32)
    assert b.tensor.shape == (0, 4) and b.size == MIN_BLOCK
    b.release()


def test_too_large_is_a_miss(arena: HostArena) -> None:
    with HostArena(64 * MiB) as big:
        assert big.alloc((MAX_BLOCK + 1,), torch.uint8) is None
        assert big.misses == 1
        ok = big.alloc((MAX_BLOCK,), torch.uint8)
        assert ok is not None and ok.size == MAX_BLOCK
        ok.release()
        assert big.misses == 1
    small_max = HostArena(MiB, max_block=64 * KiB)
    try:
        assert small_max.alloc((64 * KiB + 1,), torch.uint8) is None
        assert small_max.misses == 1
    finally:
        small_max.close()


def test_exhaustion_gives_none_and_counts_misses() -> None:
    with HostArena(64 * KiB) as a:
        blocks = [a.alloc((16 * KiB,), torch.uint8) for _ in range(4)]
        assert all(b is not None for b in blocks)
        assert a.in_use_bytes == a.capacity == 64 * KiB
        assert a.alloc((16 * KiB,), torch.uint8) is None
        assert a.alloc((1,), torch.uint8) is None
        assert a.misses == 2
        blocks[2].release()
        again = a.alloc((16 * KiB,), torch.uint8)
        assert again is not None and again.offset == blocks[2].offset
        assert a.misses == 2
        for b in blocks[:2] + blocks[3:] + [again]:
            b.release()
        assert a.in_use_bytes == 0


def test_full_region_lends_a_larger_free_block() -> None:
    with HostArena(32 * KiB) as a:
        x, y = a.alloc((16 * KiB,), torch.uint8), a.alloc((16 * KiB,), torch.uint8)
        x.release()
        small = a.alloc((100,), torch.uint8)  # no 4 KiB block, no fresh space: x's 16 KiB block, whole
        assert small is not None and small.offset == x.offset and small.size == 16 * KiB
        assert a.in_use_bytes == 32 * KiB
        small.release()
        y.release()
        # it went back to the 16 KiB list, so two 16 KiB requests still fit
        z, w = a.alloc((16 * KiB,), torch.uint8), a.alloc((16 * KiB,), torch.uint8)
        assert z is not None and w is not None and {z.offset, w.offset} == {x.offset, y.offset}
        assert a.misses == 0
        z.release()
        w.release()


def test_capacity_rounds_down_to_pages() -> None:
    with HostArena(10_000) as a:
        assert a.capacity == 8 * KiB
    with pytest.raises(ValueError):
        HostArena(100)


def test_threads_never_share_a_block() -> None:
    n_threads, rounds = 8, 400
    owned: set[int] = set()
    owned_lock = threading.Lock()
    errors: list[str] = []
    start = threading.Barrier(n_threads)

    with HostArena(2 * MiB) as a:
        def work(tid: int) -> None:
            rng = random.Random(tid)
            start.wait()
            held = []
            for i in range(rounds):
                b = a.alloc((rng.choice([10, 1000, 5000, 20_000]),), torch.uint8)
                if b is not None:
                    with owned_lock:
                        if b.offset in owned:
                            errors.append(f"block {b.offset} handed out twice")
                        owned.add(b.offset)
                    b.tensor.fill_(tid)
                    held.append(b)
                if held and (len(held) > 3 or rng.random() < 0.5):
                    # release from a different position than allocated, as the event loop would
                    r = held.pop(rng.randrange(len(held)))
                    if not bool((r.tensor == tid).all()):
                        errors.append(f"block {r.offset} overwritten while thread {tid} held it")
                    with owned_lock:
                        owned.discard(r.offset)
                    r.release()
            for r in held:
                with owned_lock:
                    owned.discard(r.offset)
                r.release()

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert a.blocks_in_use == 0 and a.in_use_bytes == 0


def test_release_on_another_thread(arena: HostArena) -> None:
    blocks = [arena.alloc((100,), torch.float32) for _ in range(50)]
    t = threading.Thread(target=lambda: [b.release() for b in blocks])
    t.start()
    t.join()
    assert arena.in_use_bytes == 0


def test_another_process_sees_the_region(arena: HostArena) -> None:
    b = arena.alloc((64,), torch.uint8)
    b.tensor.copy_(torch.arange(64, dtype=torch.uint8) * 3)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=arena_child.read_and_write, args=(arena.name, b.offset, 64, q))
    p.start()
    try:
        data = q.get(timeout=60)
    finally:
        p.join(timeout=60)
    assert p.exitcode == 0
    assert data == bytes((i * 3) % 256 for i in range(64))
    # and what the child wrote is seen here
    after = arena.tensor[b.offset + 64:b.offset + 128]
    assert after.tolist() == [255 - (i * 3) % 256 for i in range(64)]
    b.release()


def test_attach_in_process(arena: HostArena) -> None:
    b = arena.alloc((4,), torch.int32)
    b.tensor.copy_(torch.tensor([1, -2, 3, -4], dtype=torch.int32))
    shm, region = attach(arena.name)
    assert torch.equal(region[b.offset:b.offset + 16].view(torch.int32), b.tensor)
    del region
    shm.close()
    b.release()


def test_named_arena_and_duplicate_name() -> None:
    name = f"mstar_test_{uuid.uuid4().hex[:12]}"
    with HostArena(64 * KiB, name=name) as a:
        assert a.name == name
        with pytest.raises(FileExistsError):
            HostArena(64 * KiB, name=name)


def test_close_refuses_with_blocks_in_use() -> None:
    a = HostArena(64 * KiB)
    b = a.alloc((10,), torch.uint8)
    with pytest.raises(RuntimeError, match="still in use"):
        a.close()
    b.release()
    a.close()
    a.close()  # idempotent
    with pytest.raises(RuntimeError):
        a.alloc((1,), torch.uint8)


def test_forced_close_keeps_live_views_mapped() -> None:
    a = HostArena(64 * KiB)
    b = a.alloc((10,), torch.int64)
    b.tensor.fill_(7)
    with pytest.warns(UserWarning, match="blocks in use"):
        a.close(force=True)
    assert int(b.tensor.sum()) == 70  # still mapped: no dangling view
    b.release()  # harmless after close
    # the name is gone: nobody can attach any more
    with pytest.raises(FileNotFoundError):
        attach(a.name)


def test_not_pinned_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    with HostArena(64 * KiB) as a:
        assert a.pinned is False
    with pytest.raises(RuntimeError, match="needs CUDA"):
        HostArena(64 * KiB, pin=True)


def test_stage_to_host_on_cpu_returns_rows_as_they_are(arena: HostArena) -> None:
    t = torch.arange(12).view(3, 4)
    host, event, blocks = stage_to_host(t, arena)
    assert host is t and event is None and blocks == []
    rows = [torch.ones(2), torch.zeros(3)]
    host, event, blocks = stage_to_host(rows, arena)
    assert host is rows and event is None and blocks == []
    host, event, blocks = stage_to_host(t, None)
    assert host is t and event is None and blocks == []
    assert stage_to_host([], arena) == ([], None, [])
    assert arena.blocks_in_use == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage_to_host_from_cuda() -> None:
    with HostArena(4 * MiB) as a:
        assert a.pinned
        rows = [torch.randn(100, device="cuda"), torch.arange(10, device="cuda")[::2],
                torch.randn(MAX_BLOCK // 2 + 1, device="cuda")]  # the last one exceeds the max class: pinned copy
        host, event, blocks = stage_to_host(rows, a)
        assert event is not None and len(blocks) == 2
        event.synchronize()
        for h, r in zip(host, rows):
            assert h.device.type == "cpu" and torch.equal(h, r.cpu())
        assert a.misses == 1
        for b in blocks:
            b.release()
        one, event, blocks = stage_to_host(rows[0], a)
        event.synchronize()
        assert torch.equal(one, rows[0].cpu()) and len(blocks) == 1
        blocks[0].release()
