"""Pacing for `scripts/sim_scheduler.py`: which of a decode group's rows step,
and the measures that say what pacing costs and buys.

A row's lead is how far its audio runs ahead of its listener: the audio it
has produced since its first chunk, plus that chunk's frame, less the wall
time since that chunk. With pacing at lead L, a row whose lead reached L
sits out decode steps while some other row of the step lags (lead under L;
a row before its first audio always lags, so it always steps); when no row
lags, every row steps. A row that sat out rejoins once its lead falls under
L less the hysteresis H, so that the rows a step takes change less often.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

FRAME_TOKENS = 7
WINDOW_FRAMES = 4
FRAME_S = 2048 / 24_000


class Streaming(Protocol):
    """What pacing reads of a stream (`sim_scheduler.SimStream`)."""

    written: int            # decode tokens written
    chunks: list[float]     # when each audio chunk was sent


def lead(stream: Streaming, now: float) -> float:
    """Seconds of audio the stream's listener holds beyond the wall time, if
    every frame written had been sent: -inf before its first chunk."""
    if not stream.chunks:
        return -math.inf
    # whole frames only: a frame's tokens are no audio until its last one is written
    since_first = stream.written // FRAME_TOKENS - WINDOW_FRAMES
    return (since_first + 1) * FRAME_S - (now - stream.chunks[0])


class Pacer:
    """Picks the rows of a group step that run; it keeps which rows sit out."""

    def __init__(self, lead_s: float, hysteresis_s: float = 0.0) -> None:
        if not 0 < lead_s or not 0 <= hysteresis_s < lead_s:
            # a row must rejoin while its listener still holds audio, or pacing itself would stall it
            raise ValueError(f"pacing needs lead > 0 and 0 <= hysteresis < lead, not {lead_s}, {hysteresis_s}")
        self.lead_s = lead_s
        self.rejoin_s = lead_s - hysteresis_s
        self.resting: set[Streaming] = set()

    def choose(self, rows: Sequence[Streaming], now: float) -> list[Streaming]:
        """The rows of `rows` that step now, in their order: never none of them."""
        for row in rows:
            ahead = lead(row, now)
            if row in self.resting:
                if ahead < self.rejoin_s:
                    self.resting.discard(row)
            elif ahead >= self.lead_s:
                self.resting.add(row)
        stepping = [row for row in rows if row not in self.resting]
        if not stepping:  # no row lags: sitting out would only idle the device
            stepping = list(rows)
        return stepping

    def forget(self, row: Streaming) -> None:
        """`row` left the group."""
        self.resting.discard(row)


def largest_lead(streams: Iterable[Streaming], start: float, end: float) -> float:
    """The most audio (seconds) any listener held beyond the wall time, as a
    chunk sent in [start, end) arrived: what a client must be able to buffer."""
    most = 0.0
    for s in streams:
        for i, at in enumerate(s.chunks):
            if start <= at < end:
                most = max(most, (i + 1) * FRAME_S - (at - s.chunks[0]))
    return most


class DecodeStep(NamedTuple):
    """A decode step as run: when it ended, the rows it stepped, the rows the
    scheduler planned it over, and whether its rows differ from the step
    before's (in an engine, a new gather of their state)."""

    end: float
    rows: int
    planned: int
    changed: bool


def step_measures(log: Sequence[DecodeStep], step_ends: Sequence[float], start: float,
                  end: float) -> dict[str, float]:
    """What the steps over [start, end) cost the host: steps a second (every
    kind; each pays the host's fixed cost), decode steps a second and their
    rows, the share of them that sat rows out, and row-set changes a second."""
    seconds = end - start
    steps = [s for s in log if start <= s.end < end]
    n = max(len(steps), 1)
    return {
        "steps_per_s": round(sum(start <= at < end for at in step_ends) / seconds, 1),
        "decode_steps_per_s": round(len(steps) / seconds, 1),
        "rows_per_decode_step": round(sum(s.rows for s in steps) / n, 1),
        "paced_step_share": round(sum(s.rows < s.planned for s in steps) / n, 2),
        "row_set_changes_per_s": round(sum(s.changed for s in steps) / seconds, 1),
    }
