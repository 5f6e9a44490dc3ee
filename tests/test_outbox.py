"""The worker's outbox: emits whose host copies are in flight hold back what
comes after them, so a request's audio always reaches the event loop before
its end; and the graph buckets of plain modes."""

from __future__ import annotations

import torch

from mstar.config import graph_buckets
from mstar.engine.execution.backends import doubling_buckets, halfway_buckets
from mstar.engine.messages import EmitBatch, Finished, StepReport
from mstar.engine.worker.outbox import Outbox
from mstar.engine.movement.arena import stage_to_host
from mstar.engine.movement.transfer import to_device


class FakeEvent:
    """A copy that completes when the test says so."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _emit(rid: str) -> EmitBatch:
    return EmitBatch("pcm", [rid], ["codec"], torch.zeros(1, 4))


def test_ready_emits_go_straight_into_the_report() -> None:
    box, report = Outbox(), StepReport(device="cpu")
    box.emit(report, _emit("a"))
    box.finished(report, Finished("a", "codec", "stop", True))
    assert len(report.emits) == 1 and len(report.finished) == 1 and len(box) == 0


def test_an_emit_in_flight_holds_back_what_follows_it() -> None:
    box, report = Outbox(), StepReport(device="cpu")
    copy = FakeEvent()
    box.emit(report, _emit("a"), copy)
    box.emit(report, _emit("b"))                                # ready, but behind a's copy
    box.finished(report, Finished("a", "codec", "stop", True))  # a's end after a's audio
    box.release(report)
    assert report.emits == [] and report.finished == [] and len(box) == 3
    copy.done = True
    box.release(report)
    assert [e.request_ids[0] for e in report.emits] == ["a", "b"] and len(report.finished) == 1
    assert len(box) == 0


def test_release_with_wait_blocks_on_the_copies() -> None:
    box, report = Outbox(), StepReport(device="cpu")
    first, second = FakeEvent(), FakeEvent()
    box.emit(report, _emit("a"), first)
    box.emit(report, _emit("b"), second)
    box.release(report, wait=True)
    assert first.waited and second.waited and len(report.emits) == 2 and len(box) == 0


def test_cpu_rows_need_no_copy() -> None:
    rows = torch.ones(2, 3)
    host, ready, blocks = stage_to_host(rows, None)
    assert host is rows and ready is None and blocks == []
    listed, ready, _ = stage_to_host([rows[0], rows[1]], None)
    assert ready is None and len(listed) == 2


def test_to_device_on_the_cpu_is_a_plain_move() -> None:
    t = torch.arange(3)
    assert torch.equal(to_device(t, "cpu"), t)


def test_halfway_buckets() -> None:
    assert halfway_buckets((1, 2, 4, 8, 16)) == (1, 2, 3, 4, 6, 8, 12, 16)
    assert halfway_buckets((4, 1)) == (1, 2, 4)
    assert halfway_buckets((8,)) == (8,)


def test_graph_bucket_grids() -> None:
    """Decode buckets pad a step by a quarter at most from 16 rows up, an
    eighth from 256; the graph sets captured per other dimension keep the
    doublings."""
    assert graph_buckets(1) == (1,)
    assert graph_buckets(100) == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 100)
    assert graph_buckets(256)[-5:] == (128, 160, 192, 224, 256)
    grid = graph_buckets(512)
    assert grid[-8:] == (288, 320, 352, 384, 416, 448, 480, 512) and len(set(grid)) == len(grid) == 30
    assert all(b / a <= 1.25 for a, b in zip(grid, grid[1:]) if a >= 16)
    assert all(b / a <= 1.125 for a, b in zip(grid, grid[1:]) if a >= 256)
    assert doubling_buckets(grid) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert doubling_buckets(graph_buckets(100)) == (1, 2, 4, 8, 16, 32, 64, 100)
    codec = halfway_buckets(doubling_buckets(graph_buckets(256)))  # the codec windows' grid, as it was
    assert codec == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
