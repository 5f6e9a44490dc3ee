"""What a consumer partition holds of the stream it reads: the items its
producer wrote (token ids on the host, or tensor references), cut into
chunks by the stream's chunk policy, counted from the producer's current
turn (a segment). The consumer's step takes the next chunk; items no later
chunk reads are dropped. A stream that restarts its consumer at each turn
marks where a turn ended (`TURN_OVER`) and holds the values each later turn
starts the consumer with. Only the consumer's worker touches it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mstar.engine.movement.tensor_store import TensorRef
from mstar.graph import StreamPlan

# An item of a stream: a tensor in the store, or a token id the host already
# holds (a token loop's output is copied to the host for its stop rules; a
# window of ints becomes the consumer's input in one copy, not one device
# read per token).
StreamItem = TensorRef | int

TURN_OVER = (-1, -1, -1)  # in `pending`: the producer's turn ended here (a stream that restarts its consumer)


@dataclass(eq=False, slots=True)
class StreamBuffer:
    plan: StreamPlan
    items: list[StreamItem] = field(default_factory=list)
    item_base: int = 0              # stream index of items[0]
    produced: int = 0               # items received so far
    chunks_cut: int = 0
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # chunks cut, not read: start, end, index
    segment_start: int = 0          # stream index where the producer's current turn began
    segment_cuts: int = 0           # chunks cut before it
    started: bool = False           # the producer's first write started the consumer
    closed: bool = False            # the producer finished
    restarts: list[dict[str, TensorRef]] = field(default_factory=list)  # values of the turns to start again
    resting: bool = False           # the consumer's pass is over; it waits for the turn's end and the next
    turn_over: bool = False         # ... and it has seen the turn end
    fills: int = 0                  # reads an `Items` fill answered after the stream closed
    due: int = 0                    # items of the turn before the policy may cut or drop again (`ChunkPolicy.due`)

    def take(self, item: StreamItem) -> list[StreamItem]:
        """One more item; the items no chunk will read any more, taken out
        (the caller releases them)."""
        if self.append_uncut(item):
            return []  # what is kept moves only with the chunks
        self.items.append(item)
        self.produced += 1
        self._cut(self.plan.chunks.ready)
        return self.read()

    def append_uncut(self, item: StreamItem) -> bool:
        """Append `item` if it cuts no chunk (True); else leave the buffer
        as it is (False: `take` it)."""
        if self.produced + 1 - self.segment_start >= self.due:
            return False
        self.items.append(item)
        self.produced += 1
        return True

    def segment(self) -> None:
        """The producer ended a turn: cut its tail, and count anew. A turn
        that fed the stream nothing started no pass of a restarting consumer,
        so it leaves no mark: the next turn's pass must not end at it."""
        self._cut(self.plan.chunks.flush)
        fed = self.produced > self.segment_start
        self.segment_start, self.segment_cuts = self.produced, self.chunks_cut
        self.due = self.plan.chunks.due(0)
        if self.plan.on_turn == "restart" and fed:
            self.pending.append(TURN_OVER)

    def close(self) -> None:
        self.closed = True
        self._cut(self.plan.chunks.flush)

    @property
    def drained(self) -> bool:
        """Closed, and every chunk read."""
        return self.closed and not self.pending

    def next_chunk(self) -> tuple[list[StreamItem], int] | tuple[int, int, int] | None:
        """The next chunk's items (still owned by the buffer) and its index
        in the segment; None when none is cut; `TURN_OVER` (left in place)
        where the producer's turn ended."""
        if not self.pending:
            return None
        if self.pending[0] == TURN_OVER:
            return TURN_OVER
        start, end, index = self.pending.pop(0)
        return self.items[start - self.item_base: end - self.item_base], index

    def read(self) -> list[StreamItem]:
        """The items no chunk will read any more (after a chunk was read, or
        an item came), taken out (the caller releases them)."""
        s = self.segment_start
        keep = s + self.plan.chunks.keep_from(self.produced - s, self.chunks_cut - self.segment_cuts)
        if self.pending:
            keep = min(keep, self.pending[0][0])
        drop = max(0, keep - self.item_base)
        dropped = self.items[:drop]
        del self.items[:drop]
        self.item_base += drop
        return dropped

    def drop_turn(self) -> bool:
        """Drop the chunks of the current turn, unread (a consumer whose pass
        is over); True once its end was reached."""
        while self.pending:
            if self.pending.pop(0) == TURN_OVER:
                return True
        return False

    def clear(self) -> list[StreamItem]:
        """Everything still held, taken out (the consumer ended)."""
        dropped: list[StreamItem] = [*self.items, *(ref for values in self.restarts for ref in values.values())]
        self.items, self.restarts = [], []
        self.pending.clear()
        self.closed = True
        return dropped

    def _cut(self, policy: Callable[[int, int], list[tuple[int, int]]]) -> None:
        """Cut the chunks `policy` (a chunk policy's `ready` or `flush`) finds in
        the producer's current turn: a policy counts from the turn's start."""
        s, first = self.segment_start, self.chunks_cut - self.segment_cuts
        chunks = policy(self.produced - s, first)
        self.chunks_cut += len(chunks)
        self.pending.extend((s + a, s + b, first + k) for k, (a, b) in enumerate(chunks))
        self.due = self.plan.chunks.due(self.chunks_cut - self.segment_cuts)
