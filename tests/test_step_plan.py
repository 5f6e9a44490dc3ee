"""The scheduler's step plans: rows admitted with their pages, a decode
group's row window taken in turn, a page for each group row that needs one,
and, when the pool is dry, a settle first, then the youngest rows preempted
(of those taking pages as they go, first) until the others fit. Groups are
real `LoopGroup`s over Llama's decode loop."""

from __future__ import annotations

import torch

from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.memory.kv_cache import SwappedKV
from mstar.engine.worker.rows import Frame, PartitionRun, RequestRun
from mstar.graph import Loop, compile_walk
from mstar.models.llama import LlamaModel
from mstar.scheduler import ModeCaps, PagePool, Scheduler, StepPlan, WorkItem
from mstar.types import SamplingParams

PAGE = 4
DECODE = ("llm", "decode")
WALK = compile_walk("generate", LlamaModel.walks["generate"], LlamaModel.components)


def _scheduler(pages: int, max_rows: int = 8, grow: bool = True) -> Scheduler:
    caps = {("llm", "prefill"): ModeCaps(16, 1024), DECODE: ModeCaps(max_rows, 1024)}
    return Scheduler(caps, {"llm": PagePool(pages, PAGE)}, grow_pages=grow)


def _group(s: Scheduler, prompts: list[int]) -> tuple[LoopGroup, list[PartitionRun]]:
    """Rows admitted with pages for their prompts (`prompts`: tokens each),
    then joined to a decode group in that order, as the worker does."""
    pool = s.pools["llm"]
    for i, n in enumerate(prompts):
        s.add(WorkItem(f"r{i}", WALK.root, "llm", "prefill", num_tokens=n, pages_needed=pool.pages_for(n),
                       starts_row=True))
    plan = s.schedule()
    assert plan is not None and len(plan.items) == len(prompts)
    root = WALK.partitions[WALK.root]
    loop = root.nodes[1]
    assert isinstance(loop, Loop)
    group = LoopGroup("llm", "decode", torch.device("cpu"))
    s.add_group(DECODE, group)
    group.ticket = s.ticket()
    parts = []
    for i, (item, n) in enumerate(zip(plan.items, prompts)):
        run = RequestRun(item.request_id, WALK, {WALK.root: SamplingParams(seed=i)}, {WALK.root: ()})
        part = PartitionRun(run, root, pc=1, loops=[Frame(0, 100, count=1)])  # in the decode loop, after prefill
        part.row("llm").admit(list(item.granted))
        part.row("llm").advance(n, None, sampled=True)
        group.join(part, torch.tensor(7), 1, 100, ())
        parts.append(part)
    group.merge()
    return group, parts


def _carry_out(group: LoopGroup, plan: StepPlan) -> None:
    """The page side of what the worker's executor does with a plan."""
    for row in plan.preempt:
        group.evict(row).part.row("llm").swap_out(SwappedKV([], 0))  # its pages went back with the plan
    group.add_pages(plan.grow)


def test_admitted_items_come_with_their_pages_and_settle_first() -> None:
    caps = {("llm", "prefill"): ModeCaps(4, 64), ("codec", "window"): ModeCaps(4, 64)}
    s = Scheduler(caps, {"llm": PagePool(8, PAGE)})
    s.add(WorkItem("a", "llm", "llm", "prefill", num_tokens=9, pages_needed=3, starts_row=True))
    s.add(WorkItem("a", "codec", "codec", "window"))
    plan = s.schedule()
    assert plan is not None and plan.group is None and plan.has_work
    assert [len(i.granted) for i in plan.items] == [3] and s.running["llm"] == 1
    assert plan.settle  # a KV step changes pages that launched steps read
    plan = s.schedule()
    assert plan is not None and plan.component == "codec" and not plan.settle  # a plain step queues behind


def test_rows_short_of_a_page_get_one_each() -> None:
    s = _scheduler(pages=8)
    group, parts = _group(s, [4, 3, 8])  # rows 0 and 2 fill their pages exactly
    assert group.short_of_pages(PAGE) == [0, 2]
    plan = s.schedule()
    assert plan is not None and plan.group is group and not plan.settle
    assert [row for row, _ in plan.grow] == [0, 2] and not plan.preempt
    assert plan.rows == slice(0, 3)
    assert s.pools["llm"].num_free == 8 - 4 - 2
    _carry_out(group, plan)
    assert group.short_of_pages(PAGE) == []
    assert [len(p.row("llm").pages) for p in parts] == [2, 1, 3]
    assert group.block_table[0, 1] == plan.grow[0][1] and group.block_table[2, 2] == plan.grow[1][1]


def test_without_growth_the_plan_leaves_pages_alone() -> None:
    s = _scheduler(pages=8, grow=False)  # pages reserved up front: rows never run short
    group, _ = _group(s, [4, 8])
    plan = s.schedule()
    assert plan is not None and plan.group is group and not plan.grow and not plan.preempt
    assert s.pools["llm"].num_free == 5


def test_a_dry_pool_asks_for_a_settle_before_deciding() -> None:
    s = _scheduler(pages=3)
    group, _ = _group(s, [4, 4, 4])  # every row is short; the pool has nothing left
    ticket = group.ticket
    plan = s.schedule(in_flight=True)
    assert plan is not None and plan.settle and not plan.has_work and plan.group is None
    assert group.ticket == ticket and s.pools["llm"].num_free == 0  # nothing decided yet
    plan = s.schedule(in_flight=False)
    assert plan is not None and plan.group is group and group.ticket > ticket


def test_the_youngest_rows_make_room() -> None:
    s = _scheduler(pages=4)
    group, parts = _group(s, [4, 4, 3, 3])  # rows 0 and 1 are short; rows 2 and 3 hold a page each
    plan = s.schedule()
    assert plan is not None and list(plan.preempt) == [3, 2]  # youngest first, until both short rows fit
    assert [row for row, _ in plan.grow] == [0, 1] and plan.rows == slice(0, 2)
    victim_pages = {p for part in parts[2:] for p in part.row("llm").pages}
    assert {page for _, page in plan.grow} == victim_pages  # handed on in the same plan
    assert s.running["llm"] == 2 and s.pools["llm"].num_free == 0
    _carry_out(group, plan)
    assert group.rows == parts[:2] and group.short_of_pages(PAGE) == []


def test_rows_holding_all_their_pages_are_passed_over() -> None:
    """With `--kv-reservation auto`, the youngest rows that take their pages
    as they go make room; a younger row holding all of its own stays, and
    the rows after a victim move down one."""
    s = _scheduler(pages=4)
    group, parts = _group(s, [4, 3, 4, 3])  # rows 0 and 2 are short
    for i in (0, 2):
        parts[i].row("llm").takes_pages(as_it_goes=True)
    plan = s.schedule()
    assert plan is not None and list(plan.preempt) == [2]  # not row 3, younger but reserved
    assert plan.grow == [(0, parts[2].row("llm").pages[0])] and plan.rows == slice(0, 3)
    _carry_out(group, plan)
    assert group.rows == [parts[0], parts[1], parts[3]] and group.short_of_pages(PAGE) == []


def test_a_short_victim_needs_no_page() -> None:
    s = _scheduler(pages=3)
    group, parts = _group(s, [3, 4, 4])  # rows 1 and 2 are short, the pool is dry
    plan = s.schedule()
    assert plan is not None and list(plan.preempt) == [2]  # its page lets row 1 grow
    assert [row for row, _ in plan.grow] == [1] and plan.grow[0][1] == parts[2].row("llm").pages[0]
    assert plan.rows == slice(0, 2)


def test_shared_pages_free_nothing_when_their_row_is_preempted() -> None:
    s = _scheduler(pages=3)
    group, parts = _group(s, [4, 3, 3])
    pool = s.pools["llm"]
    pool.share(parts[2].row("llm").pages)  # another holder keeps row 2's page
    plan = s.schedule()
    assert plan is not None and list(plan.preempt) == [2, 1]
    assert plan.grow == [(0, parts[1].row("llm").pages[0])]
    assert pool.refcount(parts[2].row("llm").pages[0]) == 1  # one holder less, not free
    assert plan.rows == slice(0, 1)


def test_a_group_larger_than_a_step_takes_turns() -> None:
    s = _scheduler(pages=16, max_rows=2)
    group, _ = _group(s, [1, 1, 1, 1, 1])
    windows = []
    for _ in range(4):
        plan = s.schedule()
        assert plan is not None and plan.group is group
        windows.append((plan.rows.start, plan.rows.stop))
    assert windows == [(0, 2), (2, 4), (4, 5), (0, 2)]
    group.take_out("r0", None)
    group.take_out("r1", None)
    plan = s.schedule()
    assert plan is not None and plan.rows == slice(2, 3)  # the turn goes on over the rows left
    plan = s.schedule()
    assert plan is not None and plan.rows == slice(0, 2)
    group.take_out("r4", None)
    for _ in range(2):
        plan = s.schedule()
        assert plan is not None and plan.rows == slice(0, 2)  # they fit: all rows, every step


def test_a_group_steps_in_its_turn_among_queues() -> None:
    s = _scheduler(pages=16)
    group, _ = _group(s, [1, 1])
    s.add(WorkItem("late", WALK.root, "llm", "prefill", num_tokens=1, pages_needed=1, starts_row=True))
    plan = s.schedule()
    assert plan is not None and plan.group is group  # its ticket is older than the new prefill's
    plan = s.schedule()
    assert plan is not None and [i.request_id for i in plan.items] == ["late"]
    plan = s.schedule()
    assert plan is not None and plan.group is group
