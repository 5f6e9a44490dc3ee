"""A device worker's inbox drain: it applies the messages that had come when
it began, so that a stream of submits arriving as fast as they are applied
cannot hold the next step back until the stream ends."""

from __future__ import annotations

import queue

from mstar.engine.messages import Shutdown
from mstar.engine.worker.device_worker import DeviceWorker


class _Idle:
    running = False
    pending = False

    def check(self) -> None:
        pass

    def has_work(self) -> bool:
        return False


class _Worker:
    """What `DeviceWorker._drain` reads of its worker; each applied message
    may send another, as the event loop does while a burst arrives."""

    def __init__(self, sends_while_applying: int) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.profiler = self.scheduler = self.link = _Idle()
        self.applied: list[object] = []
        self.sends = sends_while_applying

    def _apply(self, msg: object) -> None:
        self.applied.append(msg)
        if self.sends:
            self.sends -= 1
            self.inbox.put(f"late{self.sends}")


def test_a_drain_applies_what_had_come_and_leaves_what_comes_meanwhile() -> None:
    w = _Worker(sends_while_applying=5)
    for i in range(3):
        w.inbox.put(f"early{i}")
    assert DeviceWorker._drain(w, block=True) is True  # type: ignore[arg-type]
    assert w.applied == ["early0", "early1", "early2"]
    # the three sent meanwhile wait for the next drain, which again takes only those
    assert w.inbox.qsize() == 3
    assert DeviceWorker._drain(w, block=False) is True  # type: ignore[arg-type]
    assert w.applied[3:] == ["late4", "late3", "late2"]
    assert w.inbox.qsize() == 2  # the two sends left
    assert DeviceWorker._drain(w, block=False) is True  # type: ignore[arg-type]
    assert w.applied[6:] == ["late1", "late0"] and w.inbox.empty()


def test_a_drain_stops_at_shutdown_and_returns_at_an_empty_inbox() -> None:
    w = _Worker(sends_while_applying=0)
    assert DeviceWorker._drain(w, block=False) is True  # type: ignore[arg-type]
    assert w.applied == []
    w.inbox.put("a")
    w.inbox.put(Shutdown())
    w.inbox.put("after")
    assert DeviceWorker._drain(w, block=True) is False  # type: ignore[arg-type]
    assert w.applied == ["a"]
