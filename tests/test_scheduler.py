"""The scheduler alone: FIFO across queues, per-mode caps, and page admission
that is all-or-nothing."""

from __future__ import annotations

import pytest

from mstar.scheduler import ModeCaps, PagePool, Scheduler, WorkItem


def _sched(max_rows: int = 4, max_tokens: int = 64, pages: int = 8) -> Scheduler:
    caps = {("llm", "prefill"): ModeCaps(max_rows, max_tokens), ("llm", "decode"): ModeCaps(max_rows, max_tokens)}
    return Scheduler(caps, {"llm": PagePool(pages, page_size=4)})


def test_page_pool_allocates_all_or_nothing_and_counts_holders() -> None:
    pool = PagePool(4, page_size=16)
    assert pool.pages_for(1) == 1 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken on failure
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(a[:1])


def test_oldest_queue_goes_first_and_caps_hold() -> None:
    s = _sched(max_rows=2)
    for i in range(3):
        s.add(WorkItem(f"d{i}", "llm", "llm", "decode"))
    s.add(WorkItem("p0", "llm", "llm", "prefill", num_tokens=10))
    b = s.schedule()
    assert b is not None and (b.mode, [i.request_id for i in b.items]) == ("decode", ["d0", "d1"])
    b = s.schedule()  # d2 (ticket 2) is older than p0 (ticket 3)
    assert b is not None and [i.request_id for i in b.items] == ["d2"]
    b = s.schedule()
    assert b is not None and b.mode == "prefill"
    assert s.schedule() is None and not s.has_work()


def test_token_cap_splits_prefills_but_a_long_prompt_still_runs_alone() -> None:
    s = _sched(max_rows=8, max_tokens=16)
    s.add(WorkItem("a", "llm", "llm", "prefill", num_tokens=10))
    s.add(WorkItem("b", "llm", "llm", "prefill", num_tokens=10))
    s.add(WorkItem("c", "llm", "llm", "prefill", num_tokens=40))
    assert [i.request_id for i in s.schedule().items] == ["a"]
    assert [i.request_id for i in s.schedule().items] == ["b"]
    assert [i.request_id for i in s.schedule().items] == ["c"]


def test_a_row_without_pages_waits_whole_and_blocks_its_queue() -> None:
    s = _sched(pages=5)
    s.add(WorkItem("a", "llm", "llm", "prefill", num_tokens=12, pages_needed=3))
    s.add(WorkItem("b", "llm", "llm", "prefill", num_tokens=12, pages_needed=3))
    s.add(WorkItem("c", "llm", "llm", "prefill", num_tokens=4, pages_needed=1))
    first = s.schedule()
    assert [i.request_id for i in first.items] == ["a"] and len(first.items[0].granted) == 3
    # b needs 3 of the 2 free pages: it waits, and c behind it does not jump ahead
    assert s.schedule() is None
    assert s.pools["llm"].num_free == 2 and s.num_waiting() == 2
    s.pools["llm"].free(first.items[0].granted)
    nxt = s.schedule()
    assert [i.request_id for i in nxt.items] == ["b", "c"]
    assert s.pools["llm"].num_free == 1


def test_remove_takes_out_one_partition_or_a_whole_request() -> None:
    s = _sched()
    s.add(WorkItem("r", "llm", "llm", "decode"))
    s.add(WorkItem("r", "codec", "llm", "prefill"))
    s.add(WorkItem("q", "llm", "llm", "decode"))
    assert [i.partition for i in s.remove("r", "codec")] == ["codec"]
    assert [i.request_id for i in s.remove("r")] == ["r"]
    assert s.num_waiting() == 1


def test_a_row_larger_than_the_pool_is_refused_at_once() -> None:
    s = _sched(pages=2)
    with pytest.raises(ValueError):
        s.add(WorkItem("a", "llm", "llm", "prefill", num_tokens=40, pages_needed=10))


def test_rows_that_would_start_past_max_running_wait() -> None:
    caps = {("llm", "prefill"): ModeCaps(8, 64)}
    s = Scheduler(caps, {"llm": PagePool(16, page_size=4)}, max_running={"llm": 2})
    for i in range(3):
        s.add(WorkItem(f"p{i}", "llm", "llm", "prefill", num_tokens=4, pages_needed=1, starts_row=True))
    b = s.schedule()
    assert b is not None and [i.request_id for i in b.items] == ["p0", "p1"] and s.running["llm"] == 2
    assert s.schedule() is None  # p2 waits for a running row to end, though pages are free
    s.row_ended("llm")
    b = s.schedule()
    assert b is not None and [i.request_id for i in b.items] == ["p2"] and s.running["llm"] == 2


def test_rows_waiting_to_start_read_from_another_thread_while_plans_run() -> None:
    """/metrics reads the count on the event loop while the worker plans; a
    plan takes rows out of their queue while it weighs them, which a count of
    the queues would catch half done."""
    import sys
    import threading
    import time

    s = _sched(pages=4)
    s.pools["llm"].allocate(4)  # every page held by a running row: each new row waits for pages
    for i in range(200):
        s.add(WorkItem(f"r{i}", "llm", "llm", "prefill", num_tokens=8, pages_needed=1, starts_row=True))
    assert s.num_to_start() == 200
    stop = threading.Event()

    def plans() -> None:
        while not stop.is_set():
            assert s.schedule() is None

    worker = threading.Thread(target=plans)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    worker.start()
    try:
        seen = []
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            seen.append(s.num_to_start())
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert len(seen) > 100 and set(seen) == {200}
    s.remove("r0")
    assert s.num_to_start() == 199
