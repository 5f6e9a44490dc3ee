"""A device worker's inbox drain: it applies the messages that had come when
it began, so that a stream of submits arriving as fast as they are applied
cannot hold the next step back until the stream ends."""

from __future__ import annotations

import queue
import threading

from mstar.engine.messages import Shutdown
from mstar.engine.worker.device_worker import DeviceWorker
from mstar.scheduler.burst_gate import BurstGate


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
        self.gate = BurstGate(0.0)
        self.submits_sent = self.submits_applied = 0
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


class _NoPlans:
    """An executor with nothing to launch: every turn of the loop ends idle."""

    in_flight = False
    outbox = None

    def next_plan(self) -> None:
        return None

    def idle(self) -> None:
        pass


class _Link(_Idle):
    def poll(self) -> None:
        pass


def test_the_loop_applies_messages_sent_meanwhile_and_stops_at_shutdown() -> None:
    """An idle worker blocks on its inbox between drains; messages sent while
    others are applied must still be applied (no turn may block with messages
    left), and the loop ends at the `Shutdown` behind them."""
    w = _Worker(sends_while_applying=50)
    w.executor, w.link = _NoPlans(), _Link()
    for i in range(5):
        w.inbox.put(f"early{i}")
    applied = w._apply

    def apply(msg: object) -> None:
        applied(msg)
        if len(w.applied) == 55:  # every message sent, then the stop
            w.inbox.put(Shutdown())
    w._apply = apply
    w._drain = lambda block: DeviceWorker._drain(w, block)  # type: ignore[arg-type]
    loop = threading.Thread(target=DeviceWorker._loop, args=(w,), daemon=True)
    loop.start()
    loop.join(timeout=10)
    assert not loop.is_alive(), f"the loop hung with {w.inbox.qsize()} messages queued"
    assert len(w.applied) == 55 and w.inbox.empty()
