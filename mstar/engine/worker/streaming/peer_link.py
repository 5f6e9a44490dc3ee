"""One worker's link to the others: the stream starts, items, turn ends and
stream ends its steps send to partitions running on other devices go out here, and
what other workers send it comes in here.

Out: messages queue per destination during a step and leave together when
the step is reported (one `Forward` per destination, in order), with a CUDA
event recorded after the step's work. In: a tensor reference that lives on
another CUDA device is copied onto this one by the destination's
`Transport` (a transfer stream waits for the sender's event; nothing waits
on the host). The copy gets its own reference; the source reference is
released once the copy has completed, not before (`poll`). Token ids and
tensors on the host pass as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mstar.engine.messages import Forward, StreamItems, StreamSegment, StreamStart
from mstar.engine.worker.rows import StreamItem
from mstar.engine.movement.tensor_store import TensorRef, TensorStore
from mstar.engine.movement.transport import Received, Transport, is_done

if TYPE_CHECKING:
    from mstar.engine.worker.streaming.edges import Streams
    from mstar.engine.worker.device_worker import DeviceWorker


class PeerLink:
    def __init__(self, device: torch.device, store: TensorStore) -> None:
        self.device = device
        self.store = store
        self.peers: list[DeviceWorker] = []  # every worker of the engine, by index
        self._outbound: dict[int, list[Any]] = {}
        self._copies: list[tuple[Received, TensorRef, str]] = []  # (copy in flight, source ref, owner)
        self._transport: Transport | None = None

    @property
    def pending(self) -> bool:
        """Copies whose source is still held."""
        return bool(self._copies)

    # ---------------------------------------------------------------- out

    def send(self, index: int, msg: object) -> None:
        """Queue `msg` for worker `index`. Consecutive items of one stream
        travel as one message."""
        queue = self._outbound.setdefault(index, [])
        last = queue[-1] if queue else None
        if (isinstance(msg, StreamItems) and isinstance(last, StreamItems)
                and (last.request_id, last.consumer) == (msg.request_id, msg.consumer)):
            last.items.extend(msg.items)
        else:
            queue.append(msg)

    def flush(self) -> None:
        """Send what the step queued (called when the step is reported)."""
        if not self._outbound:
            return
        ready = None
        if self.device.type == "cuda":  # the receiver's copies wait for the work that wrote the tensors
            ready = torch.cuda.Event()
            ready.record()
        outbound, self._outbound = self._outbound, {}
        for index, items in outbound.items():
            self.peers[index].send(Forward(str(self.device), items, ready))

    # ----------------------------------------------------------------- in

    def receive(self, msg: Forward, streams: Streams) -> None:
        for item in msg.items:
            if isinstance(item, StreamItems):
                if not self._held(item.items):
                    continue  # the request ended and the engine dropped what it held: nothing to deliver
                item.items = [self._bring(i, item.request_id, msg.ready) for i in item.items]
                streams.receive_items(item)
            elif isinstance(item, StreamStart):
                if not self._held(list(item.values.values())):
                    continue
                item.values = {k: self._bring(v, item.request_id, msg.ready) for k, v in item.values.items()}
                streams.receive_start(item)
            elif isinstance(item, StreamSegment):
                streams.receive_segment(item)
            else:
                streams.receive_end(item)

    def _held(self, items: list) -> bool:
        """Whether the store still holds every tensor `items` refer to."""
        return all(self.store.holds(i) for i in items if isinstance(i, TensorRef))

    def _bring(self, item: StreamItem, owner: str, ready: Any) -> StreamItem:
        """`item` usable on this device: a reference to a tensor on another
        CUDA device becomes a reference to its copy here."""
        if not isinstance(item, TensorRef):
            return item
        src = self.store.get(item)
        if src.device == self.device or (src.device.type == "cpu" and self.device.type == "cpu"):
            return item
        if self._transport is None:  # made by the first copy: only a worker that receives tensors needs streams
            self._transport = Transport(self.device)
        received = self._transport.receive(src, ready)
        copy = TensorRef(self.store.put(received.tensor, (owner,)))
        self._copies.append((received, item, owner))
        return copy

    def poll(self) -> None:
        """Release the sources of the copies that have completed."""
        if not self._copies:
            return
        left = []
        for received, src, owner in self._copies:
            if is_done(received):
                self.store.release(src, owner)
            else:
                left.append((received, src, owner))
        self._copies = left

    def close(self) -> None:
        """Wait for the copies in flight and release their sources."""
        for received, src, owner in self._copies:
            if received.done is not None:
                received.done.synchronize()
            self.store.release(src, owner)
        self._copies = []
