"""Whether new rows wait for the rest of a burst of arrivals.

The event loop stamps each new request with when it sent it; a worker feeds
those stamps in as it applies the requests. A request that comes within
`window_s` of the one before it opens a burst: while requests keep coming
that close together, new rows wait (`held`), and when arrivals pause for
`window_s` (or the burst has been open `cap_s`), they start together in one
prompt step. Over HTTP a burst of 64 speech requests reaches the engine
about 0.3-0.5 ms apart, one handler after another on the event loop; rows
started meanwhile run a prompt step of their own under the GIL the intake
holds, slowly, and the rest wait behind it. A request that comes alone
(nothing within `window_s` before it) starts at once: it pays nothing.

Clock: `time.monotonic()` seconds, the same on both threads.
"""

from __future__ import annotations

CAP_WINDOWS = 16  # a burst holds new rows at most this many windows in all: over HTTP 64 requests take 20-45 ms


class BurstGate:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.cap_s = window_s * CAP_WINDOWS
        self._last: float | None = None  # the latest arrival
        self._opened: float | None = None  # when the open burst's first request came; None: no burst open

    def arrived(self, at: float) -> None:
        """A new request, sent at `at`."""
        if self.window_s <= 0:
            return
        if self._last is not None and at - self._last < self.window_s and self._opened is None:
            self._opened = self._last
        self._last = at if self._last is None else max(self._last, at)

    def held(self, now: float) -> bool:
        """Whether new rows wait now; a burst that paused or ran its cap closes."""
        if self._opened is None:
            return False
        if now - self._last >= self.window_s or now - self._opened >= self.cap_s:
            self._opened = None
            return False
        return True

    def wait_s(self, now: float) -> float | None:
        """How long until an open burst lets new rows start if nothing more
        comes; None when none is open."""
        if self._opened is None:
            return None
        return max(0.0, min(self._last + self.window_s, self._opened + self.cap_s) - now)
