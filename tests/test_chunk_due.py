"""`ChunkPolicy.due`, the count of items before which a stream does not ask
its policy again: below it `ready` cuts nothing and `keep_from` keeps the
same items, and a `StreamBuffer` that skips the policy below it cuts and
drops exactly what one asking at every item does, over segments too."""

from __future__ import annotations

import pytest

from mstar.engine.worker.streaming.buffer import StreamBuffer
from mstar.graph import StreamPlan
from mstar.graph.chunks import FixedChunks, Items, Last, LeftContext, SlidingWindow

POLICIES = [SlidingWindow(28, 7), SlidingWindow(4, 4), FixedChunks(5), Items(), LeftContext(6, 3), LeftContext(4),
            Last()]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_nothing_is_cut_or_dropped_before_it_is_due(policy):
    for cut in range(6):
        due = policy.due(cut)
        for total in range(due):
            assert policy.ready(total, cut) == [], (cut, total)
            assert policy.keep_from(total, cut) == policy.keep_from(max(due - 1, 0), cut)
        if due:  # the chunk is cut once due
            assert len(policy.ready(due, cut)) == 1


class _AlwaysAsks(StreamBuffer):
    """The buffer as it was before `due`: asks the policy at every item."""

    def take(self, item):
        self.due = 0
        return super().take(item)


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_a_buffer_skipping_the_policy_cuts_and_drops_the_same(policy):
    plan = StreamPlan("codes", "llm", "codec", policy)
    fast, slow = StreamBuffer(plan), _AlwaysAsks(plan)
    dropped_fast, dropped_slow, chunks_fast, chunks_slow = [], [], [], []
    for i in range(90):
        dropped_fast += fast.take(i)
        dropped_slow += slow.take(i)
        if i % 3 == 0:  # the consumer reads what was cut so far
            for buf, chunks, dropped in ((fast, chunks_fast, dropped_fast), (slow, chunks_slow, dropped_slow)):
                while (got := buf.next_chunk()) is not None:
                    chunks.append((list(got[0]), got[1]))
                    dropped += buf.read()
        if i == 40:
            fast.segment()
            slow.segment()
        assert (fast.items, fast.item_base, fast.pending, fast.chunks_cut) == \
            (slow.items, slow.item_base, slow.pending, slow.chunks_cut), i
    assert chunks_fast == chunks_slow and dropped_fast == dropped_slow
    assert chunks_fast or isinstance(policy, Last)
