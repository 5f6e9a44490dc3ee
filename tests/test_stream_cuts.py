"""What a group step's read tells the scheduler of the step in flight
(`Streams.cuts_next`): a row whose next item cuts a chunk for a parked
consumer wakes it onto that consumer's queue when the step is read, so a
first chunk queued there waits in line (`Scheduler._leads`). The rows of all
the routes of one read count together; a buffer before its stream's first
item, or a consumer that is not parked (its step queued, or in a group),
wakes nothing."""

from __future__ import annotations

from types import SimpleNamespace

from mstar.engine.worker.streaming.buffer import StreamBuffer
from mstar.engine.worker.streaming.edges import Streams
from mstar.graph import StreamPlan
from mstar.models.orpheus.windows import PlayedWindows
from mstar.scheduler import WorkItem

AUDIO = (100, 200)  # the ids the stream takes
WINDOW = WorkItem("any", "codec", "codec", "window")


def _streams() -> Streams:
    walker = SimpleNamespace(store=None, scheduler=SimpleNamespace(steps=SimpleNamespace(most=1)))
    return Streams(walker)  # type: ignore[arg-type]


def _plan(first: int = 0) -> StreamPlan:
    return StreamPlan("token", "llm", "codec", PlayedWindows(size=28, stride=7, first=first), AUDIO, "token")


def _row(rid: str, plan: StreamPlan, items: int, parked: bool = True) -> SimpleNamespace:
    """A producer row of `rid` whose consumer's buffer holds `items` (its chunks read), parked or not."""
    buf = StreamBuffer(plan)
    for k in range(items):
        buf.take(AUDIO[0] + k % 50)
    buf.pending.clear()  # its consumer read what was cut
    step = SimpleNamespace(component="codec", mode="window")
    cons = SimpleNamespace(inbox=buf, done=False, parked=parked, request_id=rid,
                           instr=lambda: SimpleNamespace(step=step))
    run = SimpleNamespace(walk=SimpleNamespace(streams={"token": (plan,)}), partitions={"codec": cons},
                          started={"codec"} if items else set(), request_id=rid)
    return SimpleNamespace(name="llm", request=run, request_id=rid)


def test_a_row_whose_next_item_cuts_wakes_its_consumers_queue() -> None:
    streams = _streams()
    streams.begin_read()
    streams.feed_ids([_row("a", _plan(), 20)], "token", [AUDIO[0]])  # 21 items: a window at 28
    assert not streams.cuts_next(WINDOW)
    streams.begin_read()
    streams.feed_ids([_row("b", _plan(), 26)], "token", [AUDIO[0]])  # 27: the next is the 28th
    assert streams.cuts_next(WINDOW)
    assert not streams.cuts_next(WorkItem("any", "other", "codec", "window"))  # another consumer's queue
    streams.begin_read()
    streams.feed_ids([_row("c", _plan(), 5)], "token", [AUDIO[0]])  # the next read: the last one's is gone
    assert not streams.cuts_next(WINDOW)


def test_the_routes_of_one_read_count_together() -> None:
    """Orpheus's `speak` and `speak_early` rows share a decode group and
    their consumer's name: one feed a route, the first may cut."""
    streams = _streams()
    streams.begin_read()
    streams.feed_ids([_row("a", _plan(), 26)], "token", [AUDIO[0]])
    streams.feed_ids([_row("b", _plan(first=2), 20)], "token", [AUDIO[0]])
    assert streams.cuts_next(WINDOW)


def test_a_stream_not_begun_or_a_consumer_not_parked_wakes_nothing() -> None:
    streams = _streams()
    streams.begin_read()
    streams.feed_ids([_row("a", _plan(), 0)], "token", [5])  # an id the stream does not take: nothing in it yet
    assert not streams.cuts_next(WINDOW)
    streams.feed_ids([_row("b", _plan(), 26, parked=False)], "token", [AUDIO[0]])  # its step is queued already
    assert not streams.cuts_next(WINDOW)
