"""Stream edges of running requests on one worker: what a producer writes in,
into the `StreamBuffer` of the consumer partition that reads it.

Each write of a stream's source by its producer appends an item (a token id
held on the host, or a tensor reference) to the consumer's buffer, which cuts
chunks by the stream's policy, counted from the producer's current turn (a
segment). The first item starts the consumer, with the producer's values it
reads. A consumer waiting for a chunk (parked) is woken when one is cut or
the stream closes. When the producer ends a turn its streams cut their tails
and count anew; when it finishes they close.

A consumer may run on another worker (its component is placed on another
device). Then what the producer writes goes out as `StreamStart`,
`StreamItems`, `StreamSegment` and `StreamEnd` (in order, batched per step by
the worker), and the consumer's worker takes them in through `receive_*`
exactly as if they had been written there.

While launches may run several decode steps (`--num-scheduler-steps`), a
turn of a stream is watched from its first item: a launch of the producer's
component runs no further than the item that cuts the turn's first chunk
(`first_cut_room`), so that a stream's first chunk, its first audio, waits
for no later step. A consumer here is watched until its step on that chunk
has run (it queues behind the producer's launches); a consumer on another
worker, until that chunk's items are sent (its worker runs it at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mstar.engine.messages import StreamEnd, StreamItems, StreamSegment, StreamStart
from mstar.engine.worker.rows import PartitionRun, RequestRun, StreamItem
from mstar.engine.worker.streaming.buffer import TURN_OVER
from mstar.engine.movement.tensor_store import TensorRef
from mstar.graph import Items, StreamPlan

if TYPE_CHECKING:
    from mstar.engine.worker.walker import Walker
    from mstar.scheduler import WorkItem

Send = Callable[[int, object], None]  # (worker index, message)


def _writes(producer: PartitionRun | None, component: str) -> bool:
    """Whether `producer` (None: on another worker) steps rows of `component`:
    its stream's first chunk bounds that component's launches, not another's."""
    return producer is not None and any(c == component for c, _ in producer.rows)


@dataclass(eq=False, slots=True)
class _Sent:
    """A turn of a stream to a consumer on another worker, watched until its
    first chunk's items are sent."""
    producer: PartitionRun
    plan: StreamPlan
    count: int = 0  # items sent in the turn


class Streams:
    def __init__(self, walker: Walker, send: Send | None = None) -> None:
        self.walker = walker
        self.store = walker.store
        self.send = send
        # while launches may run several steps: the consumers here of producers here whose turn has written its
        # first item and whose consumer has not yet run a step on the turn's first chunk
        self._watching = walker.scheduler.steps.most > 1
        self._first: dict[int, PartitionRun] = {}
        self._sent: dict[tuple[str, str], _Sent] = {}  # by (request, consumer): the turns sent to other workers
        # the queues (consumer partition, component, mode) that the group step in flight will wake a parked
        # consumer on when it is read (a row's next item cuts a chunk), as the last read of each consumer's
        # producers left them; and the consumer partitions the read under way has fed so far
        self._cut_keys: set[tuple[str, str, str]] = set()
        self._read_fed: set[str] = set()

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
            first = sp.consumer not in run.started  # of the stream, or of a turn that restarts its consumer
            run.started.add(sp.consumer)
            if cons is None:
                if first:
                    self._send(run, sp.consumer, StreamStart(run.request_id, sp.consumer, self._carried(part, sp)))
                self._send(run, sp.consumer, StreamItems(run.request_id, sp.consumer, [item]))
                if self._watching:
                    self._count_sent(part, sp, first)
            else:
                assert cons.inbox is not None
                if first:
                    self._start(cons, self._carried(part, sp))
                if self._watching and cons.inbox.produced == cons.inbox.segment_start:
                    self._watch_first(cons)
                for ref in cons.inbox.take(item):
                    self.release(ref, run.request_id)
                if first or cons.inbox.pending:  # else no chunk was cut: a parked consumer would park again
                    self._wake(cons)

    def feed_ids(self, parts: list[PartitionRun], value: str, ids: list[int] | list[list[int]]) -> None:
        """`feed` of host token ids, one per row (a decode group's step) or
        each row's in order (a launch of several steps), the same writes: a
        row whose stream is started and whose consumer is here takes its
        items straight into the consumer's buffer, waking the consumer only
        when it is parked and a chunk waits; any other item goes through
        `feed`. At hundreds of rows a step the per-row call chain is the cost."""
        runs = bool(ids) and isinstance(ids[0], list)
        watching = self._watching
        fed: set[str] = set()  # consumer partitions fed here
        cutting: set[tuple[str, str, str]] = set()  # the queues their next items wake parked consumers on
        for part, items in zip(parts, ids):
            run = part.request
            plans = run.walk.streams.get(value, ())
            sp = plans[0] if len(plans) == 1 else None
            cons = run.partitions.get(sp.consumer) if sp is not None else None
            buf = cons.inbox if cons is not None else None
            direct = sp is not None and buf is not None and not cons.done and sp.producer == part.name
            for item in items if runs else (items,):
                if (not direct or sp.consumer not in run.started
                        or (sp.accept is not None and not sp.accept[0] <= item < sp.accept[1])):
                    # a first item, a remote or finished consumer, an id the stream does not take
                    self.feed(part, value, item)
                    continue
                if watching and buf.produced == buf.segment_start:  # the turn's first item
                    self._watch_first(cons)
                if not buf.append_uncut(item):
                    for ref in buf.take(item):
                        self.release(ref, run.request_id)
                    if buf.pending and cons.parked:
                        self._wake(cons)
                elif buf.pending and cons.parked:  # a chunk already waits for it: as `feed`, wake it
                    self._wake(cons)
            if direct:
                fed.add(sp.consumer)
                # before its first item a buffer's `due` is 0: its policy's first chunk says when it cuts
                if cons.parked and buf.produced + 1 - buf.segment_start >= (buf.due or sp.chunks.due(0)):
                    ins = cons.instr()
                    if ins is not None:
                        cutting.add((sp.consumer, ins.step.component, ins.step.mode))
        if fresh := fed - self._read_fed:  # a read's routes each feed: the first of them drops the last read's
            self._cut_keys = {key for key in self._cut_keys if key[0] not in fresh}
            self._read_fed |= fresh
        self._cut_keys |= cutting

    def begin_read(self) -> None:
        """A group step's read begins: its `feed_ids` calls (one a route)
        say together what the step launched after it will cut."""
        self._read_fed.clear()

    def cuts_next(self, item: WorkItem) -> bool:
        """Whether reading the group step in flight will wake a parked
        consumer onto `item`'s queue: its partition's name, component and
        mode (the scheduler's `cuts_next`: a first chunk goes ahead of that
        step only where it would run no more steps than in line)."""
        return (item.partition, item.component, item.mode) in self._cut_keys

    def _carried(self, part: PartitionRun, sp: StreamPlan) -> dict[str, TensorRef]:
        """The producer's values the consumer reads, each with a reference of
        the consumer's."""
        out = {}
        for name in sp.carries:
            ref = part.values[name]
            self.store.retain(ref, part.request_id)
            out[name] = ref
        return out

    def first_cut_room(self, component: str) -> int | None:
        """Items the watched stream nearest its turn's first chunk, of those
        `component`'s rows write, still needs before it cuts that chunk: 0
        once cut, until its consumer here has run its step on it (None: none
        is watched). A producer's write may not enter its stream (an id it does
        not take), so a launch bounded by it ends at that item or before."""
        left: list[int] = []
        for key, cons in list(self._first.items()):
            buf, sp = cons.inbox, cons.plan.stream
            assert buf is not None and sp is not None
            if cons.done or buf.closed:
                del self._first[key]
            elif _writes(cons.request.partitions.get(sp.producer), component):
                left.append(max(0, sp.chunks.due(0) - (buf.produced - buf.segment_start)))
        for key, sent in list(self._sent.items()):
            if sent.producer.done:
                del self._sent[key]
            elif sent.count and _writes(sent.producer, component):  # its turn has begun
                left.append(sent.plan.chunks.due(0) - sent.count)
        return min(left, default=None)

    def _count_sent(self, part: PartitionRun, sp: StreamPlan, first: bool) -> None:
        """An item of `part`'s stream went to another worker; `first`: the
        stream's first, or a restarted turn's."""
        key = (part.request_id, sp.consumer)
        if first and sp.chunks.due(0) > 0:
            self._sent[key] = _Sent(part, sp)
        sent = self._sent.get(key)
        if sent is not None:
            sent.count += 1
            if sent.count >= sp.chunks.due(0):  # the first chunk's items are on their way
                del self._sent[key]

    def _watch_first(self, cons: PartitionRun) -> None:
        """The turn of `cons`'s stream takes its first item: watch it until
        the consumer has run a step on the turn's first chunk (`consumed`),
        unless its chunk policy checks at every item (`ChunkPolicy.due`)."""
        assert cons.plan.stream is not None
        if cons.plan.stream.chunks.due(0) > 0:
            self._first[id(cons)] = cons

    def forget(self, cons: PartitionRun) -> None:
        """`cons` ended: it is watched no more."""
        self._first.pop(id(cons), None)

    def end_segment(self, part: PartitionRun) -> None:
        """`part` ended a turn and will start another: its streams cut their
        tails as at the end of a stream, and count anew."""
        for cons, sp in list(self._consumers(part)):
            if sp.on_turn == "restart":  # the next turn's first item starts it again
                part.request.started.discard(sp.consumer)
            if cons is None:
                self._send(part.request, sp.consumer, StreamSegment(part.request_id, sp.consumer))
                if self._watching and sp.chunks.due(0) > 0:  # the next turn's first chunk is counted anew
                    self._sent[(part.request_id, sp.consumer)] = _Sent(part, sp)
            else:
                self._segment(cons)

    def close(self, part: PartitionRun) -> None:
        """`part` finished: its streams close."""
        run = part.request
        for cons, sp in list(self._consumers(part)):
            if cons is None:
                self._send(run, sp.consumer, StreamEnd(run.request_id, sp.consumer, run.root_reason or "stop"))
                self._sent.pop((run.request_id, sp.consumer), None)
            else:
                self._close(cons)

    def _consumers(self, part: PartitionRun) -> Iterator[tuple[PartitionRun | None, StreamPlan]]:
        """The open consumers of `part`'s streams (None: on another worker)."""
        run = part.request
        for plans in run.walk.streams.values():
            for sp in plans:
                if sp.producer != part.name:
                    continue
                cons = run.partitions.get(sp.consumer)
                if cons is None or not (cons.done or (cons.inbox is not None and cons.inbox.closed)):
                    yield cons, sp

    def _send(self, run: RequestRun, consumer: str, msg: object) -> None:
        assert self.send is not None, "a remote consumer on a worker that cannot send"
        self.send(run.places[consumer], msg)

    # ------------------------------------------------- from another worker

    def receive_start(self, msg: StreamStart) -> None:
        cons = self._local(msg.request_id, msg.consumer)
        if cons is None:
            for ref in msg.values.values():
                self.store.release(ref, msg.request_id, missing_ok=True)
            return
        self._start(cons, msg.values)

    def receive_items(self, msg: StreamItems) -> None:
        cons = self._local(msg.request_id, msg.consumer)
        if cons is None:  # the request ended here already: drop the references it sent, if still held
            for item in msg.items:
                if isinstance(item, TensorRef):
                    self.store.release(item, msg.request_id, missing_ok=True)
            return
        assert cons.inbox is not None
        for item in msg.items:
            for ref in cons.inbox.take(item):
                self.release(ref, msg.request_id)
        self._wake(cons)

    def receive_segment(self, msg: StreamSegment) -> None:
        cons = self._local(msg.request_id, msg.consumer)
        if cons is not None:
            self._segment(cons)

    def receive_end(self, msg: StreamEnd) -> None:
        cons = self._local(msg.request_id, msg.consumer)
        if cons is not None:
            cons.request.root_reason = cons.request.root_reason or msg.reason
            self._close(cons)

    def _local(self, request_id: str, consumer: str) -> PartitionRun | None:
        run = self.walker.runs.get(request_id)
        cons = run.partitions.get(consumer) if run is not None else None
        if cons is None or cons.done or cons.inbox is None or cons.inbox.closed:
            return None
        return cons

    # ------------------------------------------------------ consumer side

    def _start(self, cons: PartitionRun, values: dict[str, TensorRef]) -> None:
        """The first item (of the stream, or of a turn that restarts the
        consumer) is on its way: the consumer starts with `values`, or keeps
        them for when its next pass starts."""
        buf = cons.inbox
        assert buf is not None
        if buf.started:
            buf.restarts.append(values)
        else:
            cons.values.update(values)
            buf.started = True
        self._wake(cons)

    def _segment(self, cons: PartitionRun) -> None:
        assert cons.inbox is not None
        cons.inbox.segment()
        self._wake(cons)

    def _close(self, cons: PartitionRun) -> None:
        assert cons.inbox is not None
        cons.inbox.close()
        if not cons.inbox.started:  # nothing ever came: there is nothing to run
            self.walker.finish(cons, cons.request.root_reason or "stop")
        else:
            self._wake(cons)

    def _wake(self, cons: PartitionRun) -> None:
        """A parked consumer may go on: a chunk was cut, or the stream closed."""
        if cons.parked and not cons.done and cons.inbox is not None and cons.inbox.started:
            cons.parked = False
            self.walker.advance(cons)

    def read(self, cons: PartitionRun) -> tuple[list[StreamItem], int] | None:
        """The next chunk for the consumer's step that reads the stream, and
        its index in the segment; None: the consumer parked (nothing cut
        yet), or the stream is over and the walker was told (`stream_done`).
        After the stream closed, and past the end of a turn of a stream whose
        consumer restarts each turn, an `Items` stream with a fill gives that."""
        buf = cons.inbox
        assert buf is not None
        got = buf.next_chunk()
        fill = buf.plan.chunks.filler(buf.fills) if isinstance(buf.plan.chunks, Items) else None
        if got == TURN_OVER:  # the producer's turn ended: so does this pass, or it reads on the fill to its own stop
            if fill is not None:
                buf.fills += 1
                return [fill], buf.chunks_cut - buf.segment_cuts
            self.walker.cursor.stream_done(cons)
            return None
        if got is not None:
            return got  # type: ignore[return-value]
        if buf.drained and fill is not None:
            buf.fills += 1
            return [fill], buf.chunks_cut - buf.segment_cuts
        if buf.drained:
            self.walker.cursor.stream_done(cons)
        else:
            cons.parked = True
        return None

    def next_pass(self, cons: PartitionRun) -> bool | None:
        """The consumer's program ran to its end. For a stream that restarts
        it at each turn: skip what is left of the turn (its own streams end
        their turn), then start again at its first node with the next turn's
        values (True), or park until they come (False). None: it is over."""
        buf = cons.inbox
        assert buf is not None
        if buf.plan.on_turn != "restart":
            return None
        rid = cons.request_id
        if not buf.resting:
            buf.resting = True
            self.end_segment(cons)
        if not buf.turn_over:
            buf.turn_over = buf.drop_turn()
            for ref in buf.read():
                self.release(ref, rid)
        if buf.turn_over and buf.restarts:
            for ref in cons.values.values():
                self.store.release(ref, rid)
            cons.values = dict(buf.restarts.pop(0))
            buf.resting = buf.turn_over = False
            buf.fills = 0  # the next turn's pass reads its own fill sequence after its items
            for row in cons.rows.values():
                row.new_turn()  # its repetition penalty looks at this turn's tokens, as its root's does
            cons.request.cut = False  # its last turn's cut is what the request's end reports
            self.walker.cursor.restart(cons, 0)
            return True
        if buf.closed:
            return None
        cons.parked = True
        return False

    def ready(self, cons: PartitionRun) -> bool:
        """A read now would give the consumer a chunk (an item, or the fill
        after the stream's end) without parking it."""
        buf = cons.inbox
        if buf is None or cons.done:
            return False
        if buf.pending:
            return buf.pending[0] != TURN_OVER
        return buf.drained and isinstance(buf.plan.chunks, Items) and buf.plan.chunks.fill is not None

    def take_items(self, parts: list[PartitionRun]) -> list[int]:
        """Each consumer's next item, read and consumed (a decode group step
        takes one per row; every row is `ready`): token ids, on the host."""
        out = []
        for cons in parts:
            chunk = self.read(cons)
            assert chunk is not None and len(chunk[0]) == 1, "a group row's stream had no item for its step"
            item = chunk[0][0]
            out.append(item if isinstance(item, int) else int(self.store.get(item)))
            self.consumed(cons)
        return out

    def consumed(self, cons: PartitionRun) -> None:
        """A step that read a chunk ran: release the items no later chunk
        reads; a watched turn whose first chunk that was is watched no more."""
        buf = cons.inbox
        assert buf is not None
        if self._first and id(cons) in self._first:
            unread = sum(chunk != TURN_OVER for chunk in buf.pending)
            if buf.chunks_cut - unread > buf.segment_cuts:  # a chunk of this turn was read
                del self._first[id(cons)]
        for ref in buf.read():
            if type(ref) is not int:  # token ids on the host hold nothing in the store
                self.release(ref, cons.request_id)

    def release(self, item: StreamItem, owner: str) -> None:
        if isinstance(item, TensorRef):
            self.store.release(item, owner)
