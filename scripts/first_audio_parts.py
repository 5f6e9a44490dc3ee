"""Where a speech request's first audio waits, in three parts: from submit
to its first code drawn (the queue and the prompt's step), from there to the
code that completes its first window (decode steps, counted), and from that
code to its first audio chunk (the codec's window and its way out).

Times are the event loop's: a code counts when the report that carries it
(`StepReport.sampled`) is read, so each part includes the read's delay the
same way alone and beside running streams. Used by `profile_tts.py`; only
requests named by `submitted` are followed, and each is dropped from the
per-report check once its first audio came, so a level's steady state pays
one empty-dict test a report.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from mstar.engine.messages import StepReport

WINDOW_CODES = 28  # Orpheus's first window: four frames of seven codes


@dataclass
class Trip:
    """One request's way to its first audio (perf_counter seconds; steps: the level's decode steps so far)."""

    submit: float
    codes: int = 0
    first_code: float | None = None
    window_code: float | None = None
    steps_at_first: int = 0
    steps_at_window: int = 0
    first_audio: float | None = None


class FirstAudioParts:
    def __init__(self, window_codes: int = WINDOW_CODES) -> None:
        self.window_codes = window_codes
        self.trips: dict[str, Trip] = {}
        self._open: dict[str, Trip] = {}  # followed and not heard yet
        self.decode_steps = 0

    def submitted(self, request_id: str) -> None:
        trip = Trip(time.perf_counter())
        self.trips[request_id] = self._open[request_id] = trip

    def heard(self, request_id: str) -> None:
        """Its first audio chunk came."""
        trip = self._open.pop(request_id, None)
        if trip is not None:
            trip.first_audio = time.perf_counter()

    def on_report(self, report: StepReport) -> None:
        """A report hook: decode steps counted, and the followed requests' codes."""
        if report.mode == "decode" and report.component:
            self.decode_steps += getattr(report, "steps", 1)
        if not self._open or not report.sampled:
            return
        now = time.perf_counter()
        for rid in report.sampled:
            trip = self._open.get(rid)
            if trip is None:
                continue
            trip.codes += 1
            if trip.codes == 1:
                trip.first_code, trip.steps_at_first = now, self.decode_steps
            if trip.codes == self.window_codes:
                trip.window_code, trip.steps_at_window = now, self.decode_steps

    def summary(self, prefix: str = "") -> str | None:
        """p50 of each part over the followed requests (whose id starts with `prefix`) that heard audio."""
        done = [t for rid, t in self.trips.items() if rid.startswith(prefix) and t.first_audio is not None
                and t.window_code is not None and t.first_code is not None]
        if not done:
            return None
        med = statistics.median
        to_code = med(t.first_code - t.submit for t in done)
        codes = med(t.window_code - t.first_code for t in done)
        steps = med(t.steps_at_window - t.steps_at_first for t in done)
        to_audio = med(t.first_audio - t.window_code for t in done)
        total = med(t.first_audio - t.submit for t in done)
        per_step = f", {1e3 * codes / steps:.2f} ms a step" if steps else ""
        return (f"first audio p50 {1e3 * total:.1f} ms over {len(done)} requests: submit -> first code "
                f"{1e3 * to_code:.1f} ms; -> code {self.window_codes} {1e3 * codes:.1f} ms ({steps:.0f} decode steps"
                f"{per_step}); -> first audio {1e3 * to_audio:.1f} ms (p50 of each part)")
