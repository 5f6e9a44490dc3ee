"""Chunk policies: how a stream's growing sequence of items is cut into
chunks for its consumer, what is cut at the end of the stream, and which
items will never be read again."""

from __future__ import annotations

from dataclasses import dataclass


class ChunkPolicy:
    """Cuts a growing sequence of stream items into chunks for the consumer."""

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        """Chunks [start, end) that can be cut now. `total`: items produced so
        far; `cut`: the number of chunks already cut."""
        raise NotImplementedError

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        """Chunks to cut when the producer has finished."""
        raise NotImplementedError

    def keep_from(self, total: int, cut: int) -> int:
        """Items before this index are never read again (they may be freed)."""
        raise NotImplementedError

    def due(self, cut: int) -> int:
        """How many items `ready` needs before it cuts chunk `cut`, or fewer
        (a stream checks `ready` and `keep_from` again only once it holds
        this many: a producer's every write otherwise calls both). The
        default, 0, checks at every item."""
        return 0


@dataclass(frozen=True)
class SlidingWindow(ChunkPolicy):
    """Windows of `size` items every `stride` items: window i is
    [i*stride, i*stride + size). At the end, if items are left that no window
    covered, the window that would have come next is cut short at the end of
    the stream, [cut*stride, total): a consumer knows it is the last by its
    length (the whole stream, when it is shorter than one window)."""

    size: int
    stride: int

    def __post_init__(self) -> None:
        if self.size <= 0 or self.stride <= 0 or self.stride > self.size:
            raise ValueError("SlidingWindow needs 0 < stride <= size")

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        out = []
        i = cut
        while i * self.stride + self.size <= total:
            out.append((i * self.stride, i * self.stride + self.size))
            i += 1
        return out

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        covered = 0 if cut == 0 else (cut - 1) * self.stride + self.size
        if total <= covered:
            return []
        return [(cut * self.stride, total)]

    def keep_from(self, total: int, cut: int) -> int:
        return cut * self.stride

    def due(self, cut: int) -> int:
        return cut * self.stride + self.size


@dataclass(frozen=True)
class FixedChunks(ChunkPolicy):
    """Consecutive chunks of `size` items; the last one may be shorter."""

    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError("FixedChunks needs size > 0")

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        return [(i * self.size, (i + 1) * self.size) for i in range(cut, total // self.size)]

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        start = cut * self.size
        return [(start, total)] if total > start else []

    def keep_from(self, total: int, cut: int) -> int:
        return cut * self.size

    def due(self, cut: int) -> int:
        return (cut + 1) * self.size


@dataclass(frozen=True)
class Items(ChunkPolicy):
    """One item per read, in order: a consumer that steps once per item the
    producer writes (a talker taking one text token per frame). A read waits
    while the stream is open and empty; after the stream closes and every
    item was read, a read gets `fill` (a token id; of a sequence, its entries
    in order, then its last again: a talker's end-of-text marker once, then
    padding), or, with no fill, the consumer's `StreamDone` loop ends. A
    consumer that restarts at each turn (`on_turn="restart"`) reads the fill
    past its turn's items too, until its own stop rule ends the pass."""

    fill: int | tuple[int, ...] | None = None

    def filler(self, reads: int) -> int | None:
        """What the read after `reads` earlier fills gets."""
        if self.fill is None or isinstance(self.fill, int):
            return self.fill
        return self.fill[min(reads, len(self.fill) - 1)]

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        return [(i, i + 1) for i in range(cut, total)]

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        return []

    def keep_from(self, total: int, cut: int) -> int:
        return cut

    def due(self, cut: int) -> int:
        return cut + 1


@dataclass(frozen=True)
class LeftContext(ChunkPolicy):
    """Chunks of `chunk` new items, each read after up to `left` items of the
    chunk before it as context (a codec that decodes with left context and
    drops the audio of those items): chunk i is [max(0, i*chunk - left),
    (i+1)*chunk). The last one may be shorter. The consumer works out how
    many items of context it got from the chunk's index (`@chunk`)."""

    chunk: int
    left: int = 0

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.left < 0:
            raise ValueError("LeftContext needs chunk > 0 and left >= 0")

    def _span(self, i: int, end: int) -> tuple[int, int]:
        return max(0, i * self.chunk - self.left), end

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        return [self._span(i, (i + 1) * self.chunk) for i in range(cut, total // self.chunk)]

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        start = cut * self.chunk
        return [self._span(cut, total)] if total > start else []

    def keep_from(self, total: int, cut: int) -> int:
        return max(0, cut * self.chunk - self.left)

    def due(self, cut: int) -> int:
        return (cut + 1) * self.chunk


@dataclass(frozen=True)
class Last(ChunkPolicy):
    """The last item alone, once the stream is over (or its turn): the result
    of a loop, decoded elsewhere (a denoised latent into a VAE on another
    device). Earlier items are dropped as later ones arrive."""

    def ready(self, total: int, cut: int) -> list[tuple[int, int]]:
        return []

    def flush(self, total: int, cut: int) -> list[tuple[int, int]]:
        return [(total - 1, total)] if total > 0 else []

    def keep_from(self, total: int, cut: int) -> int:
        return max(0, total - 1)
