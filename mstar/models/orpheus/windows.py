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
    [stride, 2 * stride) of each full window (one frame when stride is a frame)."""

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        start = cut * self.stride
        # window `cut` would start here; from its second stride on nothing was
        # played, and a consumer of whole frames needs that stride whole
        if total - start >= 2 * self.stride:
            # whole strides only: the consumer drops a trailing partial frame anyway, and a short window
            # then comes in one of a few lengths, each with CUDA graphs of its own
            return [(start, start + (total - start) // self.stride * self.stride)]
        return []
