"""A burst of arrivals starts in one prompt step (`scheduler/burst_gate.py`):
on a component with no running rows, new rows wait until arrivals pause for
the window (a lone request waits the window) or the cap passes; arrivals
that run to the cap are a stream, held no more until they pause; only the
first steps of the burst's own requests wait (not a row a running request
starts later: a talker's first, a preempted one), and running rows keep
stepping."""

from __future__ import annotations

import asyncio

import pytest

from mstar.config import EngineConfig, SchedulerConfig, parse_args
from mstar.engine.engine import Engine
from mstar.errors import ConfigError
from mstar.scheduler import ModeCaps, Scheduler, WorkItem
from mstar.scheduler.burst_gate import CAP_S, BurstGate
from mstar.types import GenerateRequest, SamplingParams
from standing_group import FakeGroup

W = 0.002


def test_a_lone_arrival_waits_the_window() -> None:
    gate = BurstGate(W)
    gate.arrived(10.0)
    assert gate.held(10.001) and gate.wait_s(10.001) == pytest.approx(0.001)
    assert not gate.held(10.0021) and gate.wait_s(10.0021) is None
    gate.arrived(10.5)  # the next one, alone too
    assert gate.held(10.5) and not gate.held(10.5021)


def test_arrivals_close_together_hold_until_they_pause() -> None:
    gate = BurstGate(W)
    gate.arrived(10.0)
    gate.arrived(10.0005)
    assert gate.held(10.001)
    assert gate.wait_s(10.001) == pytest.approx(0.0015)
    gate.arrived(10.002)  # the burst goes on
    assert gate.held(10.0035) and gate.wait_s(10.0035) == pytest.approx(0.0005)
    assert not gate.held(10.0041)  # W since the last one: the burst's rows start
    assert gate.wait_s(10.0041) is None


def test_arrivals_that_never_pause_are_held_at_most_the_cap() -> None:
    gate = BurstGate(W)
    t = 10.0
    gate.arrived(t)
    held_until = None
    while held_until is None:
        t += W / 4
        gate.arrived(t)
        if not gate.held(t):
            held_until = t
    assert held_until == pytest.approx(10.0 + CAP_S, abs=W / 4)


def test_requests_waiting_in_the_inbox_are_arriving_still() -> None:
    """A worker that woke late (the intake held the GIL) sees an old stamp,
    but more requests wait to be applied: the burst has not paused."""
    gate = BurstGate(W)
    gate.arrived(10.0)
    assert gate.held(10.005, arriving=True)
    assert not gate.held(10.005)
    gate.arrived(10.006)
    assert not gate.held(10.006 + CAP_S, arriving=True)  # the cap holds whatever waits


def test_arrivals_that_reach_the_cap_are_a_stream_held_no_more_until_they_pause() -> None:
    gate = BurstGate(W)
    t = 10.0
    assert gate.arrived(t)
    while gate.held(t):
        t += W / 2
        assert not gate.arrived(t)
    assert t == pytest.approx(10.0 + CAP_S, abs=W)
    for _ in range(100):  # the stream goes on: nothing opens, nothing is held
        t += W / 2
        assert not gate.arrived(t) and not gate.held(t)
    assert not gate.held(t + W)  # a pause ends the stream
    assert gate.arrived(t + 1.0) and gate.held(t + 1.0)


def test_a_stale_stamp_opens_nothing_that_holds() -> None:
    gate = BurstGate(W)
    gate.arrived(10.0)  # applied late: the worker reads it at 10.2
    assert not gate.held(10.2)
    assert gate.arrived(10.2005) and gate.held(10.201)  # a fresh arrival is not a stream's


def test_stamps_applied_late_count_from_when_they_were_sent() -> None:
    """A worker applies a burst's requests after its step: their stamps, not
    when it read them, say whether the burst paused."""
    gate = BurstGate(W)
    gate.arrived(10.0)
    gate.arrived(10.001)
    assert not gate.held(10.05)


def test_a_window_of_zero_holds_nothing() -> None:
    gate = BurstGate(0.0)
    for t in (1.0, 1.0001, 1.0002):
        gate.arrived(t)
        assert not gate.held(t) and gate.wait_s(t) is None


def test_a_burst_is_held_only_where_no_group_runs() -> None:
    """An idle component's new rows wait for the burst; beside running rows
    they are not held (running groups take them into their steps)."""
    caps = {("llm", "prefill"): ModeCaps(8, 100), ("llm", "decode"): ModeCaps(8, 100)}
    sched = Scheduler(caps)
    group = FakeGroup(0)
    sched.add_group(("llm", "decode"), group)
    sched.opened_burst()
    sched.add(WorkItem("new", "main", "llm", "prefill", starts_row=True, new_request=True))
    sched.held = True
    assert sched.schedule() is None and sched.held_back  # nothing runs: the worker waits for the burst to pause
    sched.held = False
    assert [i.request_id for i in sched.schedule().items] == ["new"] and not sched.held_back
    group.rows = 2
    sched.add(WorkItem("more", "main", "llm", "prefill", starts_row=True, new_request=True))
    sched.held = True
    order = []
    for _ in range(2):
        plan = sched.schedule()
        order.append("group" if plan.group is not None else [i.request_id for i in plan.items])
    assert ["more"] in order


def test_only_the_open_burst_s_rows_wait() -> None:
    """Rows queued before the burst opened (left by an earlier step's caps, or
    a prompt's next chunk) go at once, with the burst's rows that came."""
    caps = {("llm", "prefill"): ModeCaps(8, 100)}
    sched = Scheduler(caps)
    sched.add(WorkItem("old", "main", "llm", "prefill", starts_row=True, new_request=True))
    sched.opened_burst()
    sched.add(WorkItem("new", "main", "llm", "prefill", starts_row=True, new_request=True))
    sched.held = True
    assert [i.request_id for i in sched.schedule().items] == ["old", "new"]
    sched.add(WorkItem("next", "main", "llm", "prefill", starts_row=True, new_request=True))
    assert sched.schedule() is None  # a queue of the burst's rows alone waits
    sched.add(WorkItem("chunk", "main", "llm", "prefill", starts_row=False))
    assert [i.request_id for i in sched.schedule().items] == ["next", "chunk"]


def test_rows_a_running_request_starts_are_not_held() -> None:
    """A row that starts without being a new request's first step (a
    talker's first, a preempted row coming back, a prompt swapped out between
    its chunks) goes while a burst is open; a new request's first step waits."""
    caps = {("thinker", "prefill"): ModeCaps(8, 100), ("talker", "prefill"): ModeCaps(8, 100),
            ("thinker", "decode"): ModeCaps(8, 100)}
    sched = Scheduler(caps)
    sched.opened_burst()
    sched.held = True
    sched.add(WorkItem("new", "main", "thinker", "prefill", starts_row=True, new_request=True))
    sched.add(WorkItem("spoken", "talker", "talker", "prefill", starts_row=True))
    assert [i.request_id for i in sched.schedule().items] == ["spoken"]
    assert sched.schedule() is None and sched.held_back
    sched.add(WorkItem("back", "main", "thinker", "decode", starts_row=True))  # preempted, its KV coming back
    assert [i.request_id for i in sched.schedule().items] == ["back"]
    assert sched.schedule() is None
    sched.held = False
    assert [i.request_id for i in sched.schedule().items] == ["new"]


def test_a_first_step_that_started_its_row_is_new_no_more() -> None:
    """A chunked prompt's next chunk, and a row swapped out and admitted
    again, ran already: a burst that opens meanwhile does not hold them."""
    caps = {("llm", "prefill"): ModeCaps(8, 4)}
    sched = Scheduler(caps)
    item = WorkItem("long", "main", "llm", "prefill", num_tokens=10, starts_row=True, new_request=True,
                    chunkable=True)
    sched.add(item)
    assert sched.schedule().items == [item] and item.chunk == 4
    sched.next_chunk(item)
    assert not item.new_request
    sched.opened_burst()
    sched.held = True
    sched.running["llm"] = 1
    sched.requeued(item, 0)
    assert item.starts_row and not item.new_request
    assert sched.schedule().items == [item]


def test_the_flag_reaches_the_scheduler_config() -> None:
    assert parse_args(["--admission-gather-ms", "0"], {}).engine.scheduler.admission_gather_ms == 0
    assert parse_args(["--admission-gather-ms", "2"], {}).engine.scheduler.admission_gather_ms == 2.0
    assert parse_args([], {}).engine.scheduler.admission_gather_ms == 0  # opt-in: no gain measured on a GPU
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="admission-gather-ms"):
            parse_args(["--admission-gather-ms", bad], {})


async def _prompt_steps(gather_ms: float, n: int) -> tuple[list[int], list[list[int]]]:
    """Rows of each prompt step for `n` requests submitted back to back, and their tokens."""
    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(admission_gather_ms=gather_ms)))
    await eng.start()
    rows: list[int] = []
    eng.add_report_hook(lambda r: rows.append(r.rows) if r.mode == "prefill" else None)
    try:
        streams = [eng.submit(GenerateRequest(f"r{i}", eng.model_name, {"prompt_ids": [1, 2 + i, 7, 11]},
                                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
                   for i in range(n)]

        async def tokens(stream) -> list[int]:
            return [t async for c in stream for t in c.token_ids]
        return rows, list(await asyncio.gather(*(tokens(s) for s in streams)))
    finally:
        await eng.shutdown()


def test_a_burst_of_requests_starts_in_one_prompt_step_with_the_same_tokens() -> None:
    """Requests submitted back to back wait for each other and start in one
    step; a generous window (under the cap) keeps a slow CI box's gaps
    between the submits inside it."""
    gathered, tokens = asyncio.run(_prompt_steps(40.0, 8))
    assert gathered == [8]
    _, plain = asyncio.run(_prompt_steps(0.0, 8))
    assert tokens == plain and all(len(t) == 6 for t in tokens)


async def _added(model: str, requests: list[GenerateRequest], **config) -> list[WorkItem]:
    """Every work item the walker queued for `requests` run together."""
    eng = Engine(EngineConfig(model=model, devices=("cpu",), **config))
    await eng.start()
    sched = eng.workers[0].scheduler
    added: list[WorkItem] = []
    add = sched.add
    sched.add = lambda item: (added.append(item), add(item))[1]
    try:
        async def run(request: GenerateRequest) -> None:
            async for chunk in eng.submit(request):
                assert chunk.error is None, chunk.error
        await asyncio.gather(*(run(r) for r in requests))
        return added
    finally:
        await eng.shutdown()


def test_only_a_submitted_request_s_first_step_is_new() -> None:
    """The walker marks the step it queues as a Submit is applied; a talker's
    first row starts a row too, later in a running request, and is not new."""
    request = GenerateRequest("s", "qwen3-omni-tiny", {"messages": [{"role": "user", "content": "hi"}]},
                              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), walk="speak",
                              sampling_by={"talker": {"max_tokens": 3, "ignore_eos": True, "stop_token_ids": []}})
    added = asyncio.run(_added("qwen3-omni-tiny", [request], max_model_len=256))
    new = [(i.component, i.mode) for i in added if i.new_request]
    assert new == [("thinker", "prefill")]
    talker = [i for i in added if i.component == "talker"]
    assert talker and talker[0].starts_row and not talker[0].new_request


def test_a_preempted_row_coming_back_is_not_new() -> None:
    """Rows swapped out for want of pages start again, not as new requests."""
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest(f"r{i}", "tiny-llama", {"prompt_ids": list(range(5 + i, 25 + i))}, sp)
                for i in range(6)]
    added = asyncio.run(_added("tiny-llama", requests, max_model_len=128, scheduler=SchedulerConfig(
        page_size=4, num_pages=32, kv_reservation="lazy")))
    back = [i for i in added if i.starts_row and i.payload.rejoin]
    assert back and not any(i.new_request for i in back)
    assert sorted(i.request_id for i in added if i.new_request) == [f"r{i}" for i in range(6)]
