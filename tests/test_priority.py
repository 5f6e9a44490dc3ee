"""Request priority: lower goes first among rows waiting for a step (as
vLLM's `priority`), without losing the queue's place in line; the HTTP
routes read it and realtime sessions ask for REALTIME_PRIORITY."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from mstar.config import EngineConfig, SchedulerConfig
from mstar.engine.engine import Engine
from mstar.engine.eventloop.requests import RequestStream
from mstar.errors import RequestError
from mstar.http.text.protocol import parse_chat, parse_completion, parse_generate
from standing_group import FakeGroup
from mstar.scheduler import ModeCaps, PagePool, Scheduler, WorkItem
from mstar.types import REALTIME_PRIORITY, GenerateRequest, SamplingParams


def _item(rid: str, priority: int = 0, mode: str = "prefill") -> WorkItem:
    return WorkItem(rid, "main", "llm", mode, num_tokens=4, pages_needed=1, starts_row=True, priority=priority)


def test_a_better_priority_goes_ahead_in_its_queue_in_the_place_of_the_first_it_passes() -> None:
    pool = PagePool(64, 4)
    caps = {("llm", "prefill"): ModeCaps(1, 100), ("llm", "decode"): ModeCaps(8, 100)}
    sched = Scheduler(caps, {"llm": pool})
    a, b = _item("a"), _item("b")
    sched.add(a)
    decode = WorkItem("run", "main", "llm", "decode")
    sched.add(decode)
    sched.add(b)
    urgent, later = _item("rt", REALTIME_PRIORITY), _item("batch", 5)
    sched.add(later)
    sched.add(urgent)
    assert urgent.ticket == a.ticket  # it took a's place in line: ahead of the decode step queued after a
    order = []
    while (plan := sched.schedule()) is not None:
        order += [i.request_id for i in plan.items]
    assert order == ["rt", "a", "run", "b", "batch"]


def test_the_routes_read_priority_and_refuse_a_bad_one() -> None:
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "priority": -3}'
    assert parse_chat(chat).priority == -3
    assert parse_completion(b'{"prompt": "hi", "priority": 7}').priority == 7
    assert parse_generate(b'{"text": "hi"}').priority == 0
    for bad in (b'"high"', b'1.5', b'4294967296'):
        with pytest.raises(RequestError) as caught:
            parse_completion(b'{"prompt": "hi", "priority": ' + bad + b'}')
        assert caught.value.field == "priority"


async def test_a_waiting_request_of_better_priority_starts_first() -> None:
    eng = Engine(EngineConfig(model="tiny-llama", scheduler=SchedulerConfig(max_num_seqs=1)))
    await eng.start()
    order: list[str] = []

    def request(rid: str, priority: int, tokens: int) -> GenerateRequest:
        return GenerateRequest(rid, eng.model_name, {"prompt_ids": [5, 6, 7]},
                               SamplingParams(max_tokens=tokens, ignore_eos=True), priority=priority)

    async def drain(rid: str, stream: RequestStream) -> None:
        async for chunk in stream:
            if chunk.token_ids and rid not in order:
                order.append(rid)

    try:
        first = eng.submit(request("first", 0, 2000))  # holds the one running row until aborted
        async for chunk in first:
            if chunk.token_ids:
                break
        # both wait in the worker's queue (its inbox is in order) before the abort frees the row
        plain = eng.submit(request("plain", 0, 2))
        urgent = eng.submit(request("urgent", REALTIME_PRIORITY, 2))
        eng.abort("first")
        await asyncio.wait_for(asyncio.gather(drain("plain", plain), drain("urgent", urgent)), 60)
        assert order == ["urgent", "plain"]
    finally:
        await eng.shutdown()


def test_admit_every_holds_new_rows_until_running_groups_have_stepped() -> None:
    caps = {("llm", "prefill"): ModeCaps(8, 100), ("llm", "decode"): ModeCaps(8, 100)}
    sched = Scheduler(caps, admit_every=3)
    group = FakeGroup(2)
    sched.add_group(("llm", "decode"), group)
    plans = []
    for i in range(4):  # arrivals, one between each step
        sched.add(WorkItem(f"n{i}", "main", "llm", "prefill", starts_row=True))
        plan = sched.schedule()
        plans.append("group" if plan.group is not None else [item.request_id for item in plan.items])
    plans += ["group" if (p := sched.schedule()).group is not None else [i.request_id for i in p.items]
              for _ in range(4)]
    # the group stepped first (its ticket is older); the first admission then goes at once, with the arrival
    # that came meanwhile; later arrivals wait for three group steps, then go together
    assert plans == ["group", ["n0", "n1"], "group", "group", "group", ["n2", "n3"], "group", "group"]
    group.rows = 0  # nothing running: a new row never waits
    sched.add(WorkItem("late", "main", "llm", "prefill", starts_row=True))
    assert [i.request_id for i in sched.schedule().items] == ["late"]


def _order(sched: Scheduler, done: Callable[[list[str]], bool]) -> list[str]:
    """What the scheduler's plans run until `done` says so: each item's
    request, or "group" for a group step; an item's pages are taken as
    granted, and a chunked prompt's next chunk goes back in line."""
    seq: list[str] = []
    while not done(seq):
        plan = sched.schedule()
        if plan.group is not None:
            seq.append("group")
            continue
        seq += [item.request_id for item in plan.items]
        for item in plan.items:
            item.granted = []
            if item.partial:
                sched.next_chunk(item)
    return seq


def test_better_priority_chunks_and_arrivals_still_let_running_groups_step() -> None:
    """Each waiting item lends its place in line once, and a prompt's next
    chunk borrows none: otherwise its queue would keep the oldest ticket."""
    caps = {("llm", "prefill"): ModeCaps(8, 32), ("llm", "decode"): ModeCaps(8, 32)}
    sched = Scheduler(caps, {"llm": PagePool(256, 4)})
    group = FakeGroup(4)
    sched.add_group(("llm", "decode"), group)
    waiting = WorkItem("plain", "main", "llm", "prefill", num_tokens=20, pages_needed=5, starts_row=True)
    long = WorkItem("urgent", "main", "llm", "prefill", num_tokens=400, pages_needed=100, starts_row=True,
                    chunkable=True, priority=REALTIME_PRIORITY)
    sched.add(waiting)
    sched.add(long)
    seq = _order(sched, lambda seq: "plain" in seq)
    chunks = seq.count("urgent")
    assert chunks == 13 and seq[-1] == "plain"
    assert all(seq[i + 1] == "group" for i, s in enumerate(seq[:-1]) if s == "urgent" and seq[i + 1] != "plain")


def test_a_step_on_a_streams_first_chunk_goes_ahead_of_the_line_once() -> None:
    """A consumer's step on a stream's first chunk (`leads`) goes in front of
    its queue (behind leading items of its priority or better) and takes
    that queue ahead of an older group; a prompt's later chunks do not lead,
    nor does a queue once its leading items ran."""
    caps = {("llm", "prefill"): ModeCaps(8, 16), ("llm", "decode"): ModeCaps(8, 32),
            ("codec", "window"): ModeCaps(2, 2)}
    sched = Scheduler(caps, {"llm": PagePool(256, 4)})
    group = FakeGroup(4)
    sched.add_group(("llm", "decode"), group)
    assert sched.schedule().group is group  # its ticket is renewed: now behind what comes next
    late = WorkItem("late", "codec-part", "codec", "window", priority=REALTIME_PRIORITY)
    first = WorkItem("first", "codec-part", "codec", "window", priority=5, leads=True)
    second = WorkItem("second", "codec-part", "codec", "window", leads=True)
    for item in (late, first, second):
        sched.add(item)
    plan = sched.schedule()
    assert plan.group is None and [i.request_id for i in plan.items] == ["second", "first"]
    assert sched.schedule().group is group  # "late" leads nothing: the group's older ticket goes first
    assert [i.request_id for i in sched.schedule().items] == ["late"]
    long = WorkItem("long", "main", "llm", "prefill", num_tokens=40, pages_needed=10, starts_row=True,
                    chunkable=True, leads=True)
    sched.add(long)
    seq = _order(sched, lambda seq: seq.count("long") >= 3)
    assert seq[:4] == ["long", "group", "long", "group"]  # its first chunk leads; the others take turns


def test_a_first_chunk_waits_in_line_while_the_step_in_flight_cuts_more() -> None:
    """Where reading the producer's step in flight will wake a consumer onto
    the same queue (`Scheduler.cuts_next`, the walker's streams), a first
    chunk keeps its queue's place in line: ahead, it would take a consumer
    step of its own, and those chunks another. Older items of its queue keep
    theirs; with no step in flight nothing is cut meanwhile."""
    caps = {("llm", "decode"): ModeCaps(8, 32), ("codec", "window"): ModeCaps(2, 2)}
    sched = Scheduler(caps, {"llm": PagePool(64, 4)})
    group = FakeGroup(4)
    sched.add_group(("llm", "decode"), group)
    cutting = {"codec-part": True}
    sched.cuts_next = lambda item: cutting.get(item.partition, False)
    assert sched.schedule(in_flight=True).group is group
    sched.add(WorkItem("first", "codec-part", "codec", "window", leads=True))
    assert sched.schedule(in_flight=True).group is group  # in line: the group's ticket is older
    assert sched.schedule(in_flight=False).items[0].request_id == "first"  # nothing in flight: nothing cut
    # older windows than the group's renewed ticket: a first chunk in line in front of them keeps their place
    for rid in ("w1", "w2", "w3"):
        sched.add(WorkItem(rid, "codec-part", "codec", "window"))
    assert sched.schedule(in_flight=True).group is group
    assert [i.request_id for i in sched.schedule(in_flight=True).items] == ["w1", "w2"]
    sched.add(WorkItem("second", "codec-part", "codec", "window", leads=True))
    assert [i.request_id for i in sched.schedule(in_flight=True).items] == ["second", "w3"]
    sched.add(WorkItem("other", "other-part", "codec", "window", leads=True))  # another consumer's: none cut
    assert [i.request_id for i in sched.schedule(in_flight=True).items] == ["other"]
    cutting["codec-part"] = False
    assert sched.schedule(in_flight=True).group is group
    sched.add(WorkItem("third", "codec-part", "codec", "window", leads=True))
    assert [i.request_id for i in sched.schedule(in_flight=True).items] == ["third"]
