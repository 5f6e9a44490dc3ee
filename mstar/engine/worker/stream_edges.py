"""Stream edges of running requests on one worker: what a producer writes in,
chunks for the consumer out.

Each write of a stream's source by its producer appends an item (a token id
held on the host, or a tensor reference) to the consumer's buffer; the
chunk policy cuts chunks, counted from the producer's current turn (a
segment), and the consumer runs one chunk at a time. When the producer ends
a turn its streams cut their tails and count anew; when it finishes they
close, and the consumer finishes after its last chunk.

A consumer may run on another worker (its component is placed on another
device). Then what the producer writes goes out as `StreamItems`,
`StreamSegment` and `StreamEnd` (in order, batched per step by the worker),
and the consumer's worker takes them in through `receive_*` exactly as if
they had been written there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from mstar.engine.messages import StreamEnd, StreamItems, StreamSegment
from mstar.engine.worker.rows import PartitionRun, RequestRun, StreamItem
from mstar.engine.movement.tensor_store import TensorRef
from mstar.graph import StreamPlan

if TYPE_CHECKING:
    from mstar.engine.worker.walker import Walker

Send = Callable[[int, object], None]  # (worker index, message)


class Streams:
    def __init__(self, walker: Walker, send: Send | None = None) -> None:
        self.walker = walker
        self.store = walker.store
        self.send = send

    # ------------------------------------------------------ producer side

    def feed(self, part: PartitionRun, value: str, item: StreamItem) -> None:
        """A write of `value` by `part` enters the streams it feeds."""
        run = part.request
        for sp in run.walk.streams.get(value, ()):
            if sp.producer != part.name:
                continue
            cons = run.partitions.get(sp.consumer)
            if cons is not None and cons.done:
                continue
            if sp.accept is not None:
                token = item if isinstance(item, int) else int(self.store.get(item))
                if not sp.accept[0] <= token < sp.accept[1]:
                    continue
            if isinstance(item, TensorRef):
                self.store.retain(item, part.request_id)  # the consumer's reference, wherever it runs
            if cons is None:
                self._send(run, sp.consumer, StreamItems(run.request_id, sp.consumer, [item]))
            else:
                self._take(cons, sp, item)

    def end_segment(self, part: PartitionRun) -> None:
        """`part` ended a turn and will start another: its streams cut their
        tails as at the end of a stream, and count anew."""
        for cons, sp in list(self._consumers(part)):
            if cons is None:
                self._send(part.request, sp.consumer, StreamSegment(part.request_id, sp.consumer))
            else:
                self._segment(cons, sp)

    def close(self, part: PartitionRun) -> None:
        """`part` finished: its streams close."""
        run = part.request
        for cons, sp in list(self._consumers(part)):
            if cons is None:
                self._send(run, sp.consumer, StreamEnd(run.request_id, sp.consumer, run.root_reason or "stop"))
            else:
                self._close(cons, sp)

    def _consumers(self, part: PartitionRun) -> Iterator[tuple[PartitionRun | None, StreamPlan]]:
        """The open consumers of `part`'s streams (None: on another worker)."""
        run = part.request
        for plans in run.walk.streams.values():
            for sp in plans:
                if sp.producer != part.name:
                    continue
                cons = run.partitions.get(sp.consumer)
                if cons is None or not (cons.done or cons.closed):
                    yield cons, sp

    def _send(self, run: RequestRun, consumer: str, msg: object) -> None:
        assert self.send is not None, "a remote consumer on a worker that cannot send"
        self.send(run.places[consumer], msg)

    # ------------------------------------------------- from another worker

    def receive_items(self, msg: StreamItems) -> None:
        cons, sp = self._local(msg.request_id, msg.consumer)
        if cons is None:  # the request ended here already: drop the references it sent, if still held
            for item in msg.items:
                if isinstance(item, TensorRef):
                    self.store.release(item, msg.request_id, missing_ok=True)
            return
        for item in msg.items:
            self._take(cons, sp, item)

    def receive_segment(self, msg: StreamSegment) -> None:
        cons, sp = self._local(msg.request_id, msg.consumer)
        if cons is not None:
            self._segment(cons, sp)

    def receive_end(self, msg: StreamEnd) -> None:
        cons, sp = self._local(msg.request_id, msg.consumer)
        if cons is not None:
            cons.request.root_reason = cons.request.root_reason or msg.reason
            self._close(cons, sp)

    def _local(self, request_id: str, consumer: str) -> tuple[PartitionRun | None, StreamPlan]:
        run = self.walker.runs.get(request_id)
        cons = run.partitions.get(consumer) if run is not None else None
        if cons is None or cons.done or cons.closed:
            return None, None  # type: ignore[return-value]
        assert cons.plan.stream is not None
        return cons, cons.plan.stream

    # ------------------------------------------------------ consumer side

    def _take(self, cons: PartitionRun, sp: StreamPlan, item: StreamItem) -> None:
        cons.items.append(item)
        cons.produced += 1
        self._cut(cons, sp.chunks.ready)
        self.pump(cons)

    def _segment(self, cons: PartitionRun, sp: StreamPlan) -> None:
        self._cut(cons, sp.chunks.flush)
        cons.segment_start, cons.segment_cuts = cons.produced, cons.chunks_cut
        self.pump(cons)

    def _close(self, cons: PartitionRun, sp: StreamPlan) -> None:
        cons.closed = True
        self._cut(cons, sp.chunks.flush)
        self.pump(cons)

    @staticmethod
    def _cut(cons: PartitionRun, policy: Callable[[int, int], list[tuple[int, int]]]) -> None:
        """Cut the chunks `policy` (a chunk policy's `ready` or `flush`) finds in
        the producer's current turn: a policy counts from the turn's start."""
        s, first = cons.segment_start, cons.chunks_cut - cons.segment_cuts
        chunks = policy(cons.produced - s, first)
        cons.chunks_cut += len(chunks)
        cons.pending.extend((s + a, s + b, first + k) for k, (a, b) in enumerate(chunks))

    def pump(self, cons: PartitionRun) -> None:
        """Queue the consumer's next chunk, or finish it once its stream has
        closed and every chunk has run."""
        if cons.busy or cons.done:
            return
        if cons.pending:
            start, end, index = cons.pending.pop(0)
            refs = cons.items[start - cons.item_base: end - cons.item_base]
            step = cons.current_step()
            assert cons.plan.stream is not None
            for name in step.outputs:  # a seeded consumer draws by its chunk's place in the segment
                cons.writes[name] = index
            inputs: dict[str, TensorRef | list[StreamItem] | int] = {
                n: refs if n == cons.plan.stream.source else index if n == "@chunk" else cons.values[n]
                for n in step.inputs}
            self.walker.enqueue(cons, step, inputs)
        elif cons.closed:
            self.walker.finish(cons, cons.request.root_reason or "stop")

    def consumed(self, cons: PartitionRun) -> None:
        """A chunk ran: release the items no later chunk reads."""
        sp = cons.plan.stream
        assert sp is not None
        s = cons.segment_start
        keep = s + sp.chunks.keep_from(cons.produced - s, cons.chunks_cut - cons.segment_cuts)
        if cons.pending:
            keep = min(keep, cons.pending[0][0])
        drop = max(0, keep - cons.item_base)
        for ref in cons.items[:drop]:
            self.release(ref, cons.request_id)
        del cons.items[:drop]
        cons.item_base += drop
        self.pump(cons)

    def release(self, item: StreamItem, owner: str) -> None:
        if isinstance(item, TensorRef):
            self.store.release(item, owner)
