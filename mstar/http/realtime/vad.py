"""Server VAD: PCM16 samples in, the moments a speaker starts and stops out.

An energy detector over 20 ms frames. A frame is voiced when its RMS level,
in dBFS, maps at or above the session's `threshold` on a scale where 0 is
-70 dBFS (below a quiet room's floor through a laptop microphone) and 1 is
-10 dBFS (shouting close to it); the default 0.5 is -40 dBFS, between room
noise (-55 to -60) and conversational speech (-35 to -20). Speech starts
after `START_FRAMES` voiced frames in a row (one click or pop is not a
turn), dated from the first of them less `prefix_padding_ms` (the soft
onset before the level rose is part of the word); it stops after
`silence_duration_ms` without a voiced frame, dated at the end of the last
voiced one. The defaults are OpenAI's (0.5, 300 ms, 500 ms): clients tuned
against its server VAD keep their meaning here. Times are milliseconds of
input audio since the session began, as `audio_start_ms` / `audio_end_ms` are.

`TurnDetection` is the session's `turn_detection` object, checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar.http.realtime.protocol import ProtocolError, field_of

FRAME_MS = 20
START_FRAMES = 3     # 60 ms of voiced frames in a row start speech
FLOOR_DB = -70.0     # threshold 0
CEILING_DB = -10.0   # threshold 1
MAX_PADDING_MS = 10_000
MAX_SILENCE_MS = 60_000


@dataclass
class TurnDetection:
    """`audio.input.turn_detection` of type `server_vad`."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None}

    @classmethod
    def parse(cls, obj: Any, where: str, current: TurnDetection | None) -> TurnDetection:
        """A `turn_detection` object; fields it leaves out keep `current`'s
        values (or the defaults)."""
        if not isinstance(obj, dict):
            raise ProtocolError(f"'{where}' must be an object or null", "invalid_value", where)
        kind = obj.get("type", "server_vad")
        if kind != "server_vad":
            raise ProtocolError(f"turn detection type {kind!r} is not supported (only 'server_vad', or null for "
                                "none)", "unsupported_turn_detection", f"{where}.type")
        base = current or cls()
        threshold = field_of(obj, "threshold", (int, float), where, required=False)
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ProtocolError(f"'{where}.threshold' must be in [0, 1]", "invalid_value", f"{where}.threshold")
        padding = field_of(obj, "prefix_padding_ms", int, where, required=False)
        if padding is not None and not 0 <= padding <= MAX_PADDING_MS:
            raise ProtocolError(f"'{where}.prefix_padding_ms' must be in [0, {MAX_PADDING_MS}]", "invalid_value",
                                f"{where}.prefix_padding_ms")
        silence = field_of(obj, "silence_duration_ms", int, where, required=False)
        if silence is not None and not FRAME_MS <= silence <= MAX_SILENCE_MS:
            raise ProtocolError(f"'{where}.silence_duration_ms' must be in [{FRAME_MS}, {MAX_SILENCE_MS}]",
                                "invalid_value", f"{where}.silence_duration_ms")
        create = field_of(obj, "create_response", bool, where, required=False)
        interrupt = field_of(obj, "interrupt_response", bool, where, required=False)
        if obj.get("idle_timeout_ms") is not None:
            raise ProtocolError("idle timeouts are not supported; leave it null", "invalid_value",
                                f"{where}.idle_timeout_ms")
        return cls(float(threshold) if threshold is not None else base.threshold,
                   padding if padding is not None else base.prefix_padding_ms,
                   silence if silence is not None else base.silence_duration_ms,
                   create if create is not None else base.create_response,
                   interrupt if interrupt is not None else base.interrupt_response)


@dataclass(frozen=True)
class VadEvent:
    """`started` or `stopped`, at `ms` of the session's input audio."""

    kind: str
    ms: int


class EnergyVad:
    """The detector's state across appends; feed it every sample in order."""

    def __init__(self, rate: int, settings: TurnDetection, origin_ms: int = 0) -> None:
        self.rate = rate
        self.origin_ms = origin_ms  # the session's input audio before this detector began
        self.settings = settings
        self.frame = rate * FRAME_MS // 1000
        level = FLOOR_DB + settings.threshold * (CEILING_DB - FLOOR_DB)
        # compared on the mean square of int16 samples: no log or sqrt per frame
        self._power = (32768.0 * 10 ** (level / 20)) ** 2
        self._rest = np.zeros(0, dtype=np.int16)
        self._frames = 0          # frames judged so far
        self._run = 0             # voiced frames in a row
        self._last_voiced = -1    # index of the last voiced frame
        self.speaking = False

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """The events `samples` (int16, following what came before) cause."""
        data = np.concatenate([self._rest, samples]) if self._rest.size else samples
        whole = data.size // self.frame
        self._rest = data[whole * self.frame:].copy()
        if whole == 0:
            return []
        frames = data[:whole * self.frame].astype(np.float32).reshape(whole, self.frame)
        voiced = (frames * frames).mean(axis=1) >= self._power
        events = []
        silence_frames = self.settings.silence_duration_ms // FRAME_MS
        for v in voiced.tolist():
            i = self._frames
            self._frames += 1
            if v:
                self._run += 1
                self._last_voiced = i
                if not self.speaking and self._run >= START_FRAMES:
                    self.speaking = True
                    start = (i + 1 - START_FRAMES) * FRAME_MS - self.settings.prefix_padding_ms
                    events.append(VadEvent("started", self.origin_ms + max(0, start)))
            else:
                self._run = 0
                if self.speaking and i - self._last_voiced >= silence_frames:
                    self.speaking = False
                    events.append(VadEvent("stopped", self.origin_ms + (self._last_voiced + 1) * FRAME_MS))
        return events

    def force_stop(self, ms: int) -> VadEvent | None:
        """End a turn that ran out of buffer at `ms`."""
        if not self.speaking:
            return None
        self.speaking = False
        self._run = 0
        return VadEvent("stopped", ms)
