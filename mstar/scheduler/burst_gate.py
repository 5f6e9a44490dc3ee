"""Whether new rows wait for the rest of a burst of arrivals.

The event loop stamps each new request with when it sent it; a worker feeds
those stamps in as it applies the requests. New rows wait (`held`) until
`window_s` has passed since the latest arrival with no request waiting to be
applied, or `CAP_S` since the burst's first: then every prompt that came
starts in one prompt step. A request that comes alone waits `window_s`. The
worker itself may wake late (the intake holds the GIL): what waits in its
inbox is arriving still, however old the last stamp it applied. Over HTTP a burst of 64 speech requests
reaches the engine ~0.3-0.5 ms apart, one handler after another on the event
loop; a worker that started the first at once ran its prompt step (and the
decode steps after it) beside the intake under one GIL, and the rest of the
burst waited for those steps before its own prompt step.

A burst that ran to its cap is a stream, not a burst: no new one opens until
arrivals pause, so steady arrivals are held once, not every `CAP_S`. The
worker's scheduler holds only the first rows of the open burst's requests
(`opened`, `WorkItem.new_request`): rows queued before it, left by an earlier
step, or started later by a running request (a talker's first, a preempted
row coming back) start when their turn comes.

Clock: `time.monotonic()` seconds, the same on both threads.
"""

from __future__ import annotations

CAP_S = 0.05  # a burst holds new rows at most this long: over HTTP 64 requests took 20-52 ms to come in


class BurstGate:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: float | None = None  # the latest arrival
        self._opened: float | None = None  # the first arrival of the open burst; None: none open
        self._streaming = False  # the last burst ran to the cap: none opens until arrivals pause

    def arrived(self, at: float) -> bool:
        """A new request, sent at `at`; True when it opens a burst."""
        if self.window_s <= 0:
            return False
        paused = self._last is None or at - self._last >= self.window_s
        self._last = at if self._last is None else max(self._last, at)
        if self._streaming and paused:
            self._streaming = False
        if self._opened is None and not self._streaming:
            self._opened = at
            return True
        return False

    def held(self, now: float, arriving: bool = False) -> bool:
        """Whether new rows wait now (`arriving`: requests wait in the inbox);
        a burst that paused or ran its cap closes."""
        if self._opened is None:  # a stream ends at the next arrival after a pause (`arrived`)
            return False
        if not arriving and now - self._last >= self.window_s:
            self._opened = None
            return False
        if now - self._opened >= CAP_S:  # still arriving at the cap
            self._opened, self._streaming = None, True
            return False
        return True

    def wait_s(self, now: float) -> float | None:
        """How long until an open burst lets new rows start if nothing more
        comes; None when none is open."""
        if self._opened is None:
            return None
        return max(0.0, min(self._last + self.window_s, self._opened + CAP_S) - now)
