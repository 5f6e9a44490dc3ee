"""The input audio buffer: the client's PCM16 appends in, committed turns out.

Appended audio (24 kHz mono PCM16) waits here until a commit (the client's,
or the server VAD's when speech stops) takes it as a user turn; `clear`
drops it. With server VAD on, the detector hears every sample: while nobody
speaks only the last `prefix_padding_ms` and a little more are kept (that is
all a turn can reach back to), so an open microphone never fills the buffer;
a turn that outgrows the limit is ended there. With VAD off, an append past
the limit is refused. Positions are milliseconds since the session's first
input sample, the clock of `audio_start_ms` / `audio_end_ms`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mstar.http.realtime.protocol import ProtocolError
from mstar.http.realtime.vad import FRAME_MS, START_FRAMES, EnergyVad, TurnDetection, VadEvent

INPUT_RATE = 24_000      # what the client sends
MODEL_RATE = 16_000      # what a hearing model's audio encoder reads
MIN_COMMIT_MS = 100      # OpenAI's floor for a committed turn
OFF_LOOP_SAMPLES = 10 * INPUT_RATE  # longer turns are resampled on a thread


@dataclass(frozen=True)
class Turn:
    """Committed audio: PCM16 at `INPUT_RATE` and where it lay in the session."""

    pcm: bytes
    start_ms: int
    end_ms: int

    async def for_model(self, resample: Callable[[np.ndarray, int, int], np.ndarray]) -> np.ndarray:
        """Mono float32 at `MODEL_RATE`, as a hearing model's messages carry it."""
        samples = np.frombuffer(self.pcm, dtype=np.int16).astype(np.float32) / 32768.0
        if samples.size < OFF_LOOP_SAMPLES:
            return resample(samples, INPUT_RATE, MODEL_RATE)
        return await asyncio.to_thread(resample, samples, INPUT_RATE, MODEL_RATE)


class InputAudioBuffer:
    def __init__(self, max_seconds: float, turn_detection: TurnDetection | None) -> None:
        self.max_samples = int(max_seconds * INPUT_RATE)
        self.received = 0          # samples appended in the session
        self.start = 0             # the session sample the buffer's first one is
        self.samples = np.zeros(0, dtype=np.int16)
        self.vad: EnergyVad | None = None
        self.detect(turn_detection)

    def detect(self, settings: TurnDetection | None) -> None:
        """Turn detection from now on (None: off); a turn in progress is forgotten."""
        self.vad = EnergyVad(INPUT_RATE, settings, self.ms(self.received)) if settings is not None else None

    @staticmethod
    def ms(samples: int) -> int:
        return samples * 1000 // INPUT_RATE

    @property
    def buffered_ms(self) -> int:
        return self.ms(self.samples.size)

    def append(self, pcm: bytes) -> list[VadEvent]:
        """Add PCM16; the VAD's events it caused, a forced stop last."""
        new = np.frombuffer(pcm, dtype=np.int16)
        if self.vad is None and self.samples.size + new.size > self.max_samples:
            raise ProtocolError(f"the input audio buffer may hold at most {self.max_samples // INPUT_RATE} s; "
                                "commit or clear it first", "input_audio_buffer_full", "audio")
        self.samples = np.concatenate([self.samples, new])
        self.received += new.size
        if self.vad is None:
            return []
        events = self.vad.feed(new)
        if self.vad.speaking and self.samples.size >= self.max_samples:
            stop = self.vad.force_stop(self.ms(self.start + self.max_samples))
            events.append(stop)
        if not self.vad.speaking and not (events and events[-1].kind == "stopped"):
            self._keep_recent()
        return events

    def commit(self, end_ms: int | None = None) -> Turn:
        """Take the buffer up to `end_ms` (all of it by default) as a turn."""
        end = self.samples.size if end_ms is None else min(self.samples.size,
                                                           max(0, end_ms * INPUT_RATE // 1000 - self.start))
        if self.ms(end) < MIN_COMMIT_MS:
            raise ProtocolError(f"the input audio buffer holds {self.ms(end)} ms; a commit needs at least "
                                f"{MIN_COMMIT_MS} ms", "input_audio_buffer_commit_empty")
        turn = Turn(self.samples[:end].tobytes(), self.ms(self.start), self.ms(self.start + end))
        self.samples = self.samples[end:].copy()
        self.start += end
        return turn

    def drop_before(self, ms: int) -> None:
        """Forget the audio before `ms` (speech started there)."""
        cut = min(self.samples.size, max(0, ms * INPUT_RATE // 1000 - self.start))
        self.samples = self.samples[cut:].copy()
        self.start += cut

    def clear(self) -> None:
        """Drop what the buffer holds, and the turn the VAD saw start in it:
        its end would stop an item that is never committed."""
        self.start += self.samples.size
        self.samples = np.zeros(0, dtype=np.int16)
        if self.vad is not None:
            self.detect(self.vad.settings)

    def _keep_recent(self) -> None:
        # what a start detected later can reach back to: its padding, its run of voiced frames, a frame in flight
        vad = self.vad
        assert vad is not None
        keep_ms = vad.settings.prefix_padding_ms + (START_FRAMES + 2) * FRAME_MS
        self.drop_before(self.ms(self.received) - keep_ms)
