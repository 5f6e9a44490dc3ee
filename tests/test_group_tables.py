"""A decode group's host tables across launches: a launched step's Pending
keeps the lengths and counts of that step while later steps (of every row,
or of a window of them) advance the group's; the stop ids a row may not draw
yet (`min_tokens`) are banned until its count reaches it, also for a row that
joins after no row was short any more. Groups are real `LoopGroup`s over
Llama's decode loop."""

from __future__ import annotations

import torch

from mstar.engine.worker.groups.loop_group import LoopGroup
from mstar.engine.worker.rows import Frame, PartitionRun, RequestRun
from mstar.graph import compile_walk
from mstar.models.llama import LlamaModel
from mstar.types import SamplingParams

WALK = compile_walk("generate", LlamaModel.walks["generate"], LlamaModel.components)


def _join(group: LoopGroup, i: int, kv_len: int, min_tokens: int = 0) -> PartitionRun:
    run = RequestRun(f"r{i}", WALK, {WALK.root: SamplingParams(seed=i)}, {WALK.root: (2,)})
    part = PartitionRun(run, WALK.partitions[WALK.root], pc=1, loops=[Frame(0, 100, count=1)])
    part.row("llm").admit(list(range(8 * i, 8 * i + 8)))
    part.row("llm").advance(kv_len, None, sampled=True)
    group.join(part, torch.tensor(7), 1, 100, (2,), min_tokens=min_tokens)
    return part


def test_pending_keeps_its_step_while_later_steps_advance_the_group() -> None:
    group = LoopGroup("llm", "decode", torch.device("cpu"))
    for i, n in enumerate((3, 5, 9)):
        _join(group, i, n)
    group.merge()
    first = group.launched(slice(0, 3), torch.tensor([4, 5, 6]))
    window = group.launched(slice(1, 3), torch.tensor([8, 9]))
    every = group.launched(slice(0, 3), torch.tensor([1, 1, 1]))
    assert first.kv_lens.tolist() == [4, 6, 10] and first.counts.tolist() == [2, 2, 2]
    assert first.counters.tolist() == [2, 2, 2]
    assert window.kv_lens.tolist() == [7, 11] and window.counts.tolist() == [3, 3]
    assert every.kv_lens.tolist() == [5, 8, 12] and every.counts.tolist() == [3, 4, 4]
    assert group.kv_lens.tolist() == [5, 8, 12] and group.counters.tolist() == [3, 4, 4]
    assert group.tokens.tolist() == [1, 1, 1] and first.host.tolist() == [4, 5, 6]
    assert group.sampling is not None and group.sampling.counters.tolist() == [3, 4, 4]
    assert [kv is part.row("llm") for kv, part in zip(every.kv, every.rows)] == [True] * 3


def test_stop_ids_are_banned_below_min_tokens_also_for_a_late_joiner() -> None:
    group = LoopGroup("llm", "decode", torch.device("cpu"))
    _join(group, 0, 3, min_tokens=2)
    group.merge()
    banned = group.banned(slice(0, 1))
    assert banned is not None and banned.tolist() == [[2]]
    group.launched(slice(0, 1), torch.tensor([4]))  # count 2: no longer short
    assert group.banned(slice(0, 1)) is None and not group.banning
    _join(group, 1, 5, min_tokens=3)
    group.merge()
    banned = group.banned(slice(0, 2))
    assert banned is not None and banned.tolist() == [[-1], [2]]
    assert group.short_of_pages(1) == [] and group.short_of_pages(0) == [0, 1]


def test_pages_added_together_land_as_one_at_a_time() -> None:
    """`add_pages`: rows' new pages at the ends of their block tables (widened as needed), a row named twice
    taking both in order, as one call a page would."""
    group = LoopGroup("llm", "decode", torch.device("cpu"))
    parts = [_join(group, i, 3) for i in range(3)]
    group.merge()
    group.add_pages([(2, 90), (0, 91)])
    group.add_pages([(1, 92), (1, 93)])
    group.add_pages([])
    assert group.page_counts.tolist() == [9, 10, 9]
    assert group.block_table.shape == (3, 10)
    assert group.block_table[:, 8:].tolist() == [[91, 0], [92, 93], [90, 0]]
    assert [p.row("llm").pages[8:] for p in parts] == [[91], [92, 93], [90]]
