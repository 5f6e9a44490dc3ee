"""The chunk policy of Orpheus's audio stream: SNAC windows of 4 frames every
frame, whose flush never leaves a heard frame behind.

Orpheus decodes 28 audio tokens (4 frames) each time a frame completes and
keeps only the second frame of the window (decoder.py: audio_hat[:, :,
2048:4096]): the first frame gives left context, the last two right context.
Window i therefore plays frame i + 1.

`SlidingWindow.flush` cuts the next window short only when some token was
covered by no window. When the stream ends exactly at a window's end (the
usual case: the model writes whole frames), every token was covered but the
last two frames were only ever right context, never played. This policy cuts
the next window short whenever it holds a frame that has not been played:
its consumer (`OrpheusCodec.window`) plays a short window from its second
frame to its end, so every whole frame but the first reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.graph import SlidingWindow


@dataclass(frozen=True)
class PlayedWindows(SlidingWindow):
    """`SlidingWindow(size, stride)` whose consumer plays item range
    [stride, 2 * stride) of each full window (one frame when stride is a frame).

    `first` (strides; 0: a full window): the first chunk is the stream's
    first `first` strides, cut as soon as they are written; its consumer
    plays it as a short window, from its second stride to its end. The full
    windows then go on from the one that plays the next stride. With
    `first=2` the first audio comes 2 frames (14 tokens) after the stream
    starts instead of 4, its one frame decoded without the 2 frames of right
    context a full window gives it; every later frame is the same. The next
    chunk comes 3 strides after the first, so the producer must run at 3x
    real time meanwhile, or the listener waits once."""

    first: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.first and not 2 <= self.first <= self.size // self.stride:
            raise ValueError(f"PlayedWindows' first chunk must hold 2 to {self.size // self.stride} strides")

    def _chunk(self, i: int) -> tuple[int, int]:
        """Chunk i's item range, if the stream runs on."""
        full = self.size // self.stride
        if not self.first or self.first == full:
            return i * self.stride, i * self.stride + self.size
        if i == 0:
            return 0, self.first * self.stride
        window = i + self.first - 2   # the full window that plays stride `first + i - 1`
        return window * self.stride, window * self.stride + self.size

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        out = []
        while (chunk := self._chunk(cut + len(out)))[1] <= total:
            out.append(chunk)
        return out

    def keep_from(self, total: int, cut: int) -> int:
        return self._chunk(cut)[0]

    def due(self, cut: int) -> int:
        return self._chunk(cut)[1]

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        start = self._chunk(cut)[0]
        # the next chunk would start here; from its second stride on nothing was
        # played, and a consumer of whole frames needs that stride whole
        if total - start >= 2 * self.stride:
            # whole strides only: the consumer drops a trailing partial frame anyway, and a short window
            # then comes in one of a few lengths, each with CUDA graphs of its own
            return [(start, start + (total - start) // self.stride * self.stride)]
        return []
