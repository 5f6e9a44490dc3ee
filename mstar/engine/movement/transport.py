"""Tensors handed from one device's worker to another's, in one process:
`Transport(dst).receive(src, ready)` queues a copy of `src` onto `dst` behind
the producer's `ready` event and returns at once with the copy and its `done`
event. The host never waits; every ordering is a GPU-side stream wait.

Streams involved in a CUDA -> CUDA copy (torch issues a cross-device copy on
the *source* device's current stream, so the copy gets a stream there too):

    producer stream (src dev) --ready--> side stream (src dev): memcpy over NVLink/PCIe
                                         transfer stream (dst dev): waits for the memcpy, records `done`
    consumer's current stream (dst dev) waits on `done`

The side stream is this transport's own, so the copy neither queues behind
the producer's later steps (the producer's stream) nor behind the consumer's
(the destination's current stream).

Lifetimes: `src` is `record_stream`ed for the side stream, so the producer
may drop it right after handing it over (its memory is not reused before the
copy ran). The received tensor is allocated on the transfer stream and
`record_stream`ed for the destination's current stream at the call; a
consumer that uses it on another stream records that stream itself.

Ordering: torch joins the side stream with the destination's transfer stream
before the copy, so copies into one device finish in the order `receive` was
called: a copy whose `ready` lies far ahead holds back later copies into the
same device (on the GPU only; the host never waits).

One `Transport` per destination device, used from that device's worker
thread (the current stream it makes wait is that thread's).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Received:
    """A tensor on the destination, and the event recorded after the copy
    that made it (None when nothing was copied, or the copy already ordered
    itself before the caller's work). On the host (a CUDA -> CPU receive) wait
    on `done` before reading `tensor`."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None = None


def is_done(received: Received) -> bool:
    """Whether the copy behind `received` has finished (without waiting)."""
    return received.done is None or received.done.query()


class Transport:
    """Copies into `device` (the destination). `peer_access[i]`: whether
    cuda:i can write into this device directly (NVLink/PCIe P2P); torch
    enables it at the first copy from cuda:i (`enable_peer` does it now)."""

    is_done = staticmethod(is_done)

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        self.peer_access: dict[int, bool] = {}
        self._side: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # the side streams are made lazily; cheap insurance if shared
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device)
            for i in range(torch.cuda.device_count()):
                if i != device.index:
                    self.peer_access[i] = self._can_access(i, device.index)

    @staticmethod
    def _can_access(src: int, dst: int) -> bool:
        try:
            return bool(torch.cuda.can_device_access_peer(src, dst))
        except (RuntimeError, AssertionError):
            return False  # a device that cannot be queried is one we do not copy from directly

    def _side_stream(self, index: int) -> torch.cuda.Stream:
        s = self._side.get(index)
        if s is None:
            with self._lock:
                s = self._side.get(index)
                if s is None:
                    s = self._side[index] = torch.cuda.Stream(device=torch.device("cuda", index))
        return s

    def enable_peer(self, src: torch.device | str | int) -> bool:
        """Enable peer access from `src` now (a one-element copy, at startup:
        this synchronises), so the first real copy does not pay for it. Returns
        `peer_access` for it."""
        index = src if isinstance(src, int) else torch.device(src).index
        if self.stream is None or index is None or index == self.device.index:
            return False
        probe = torch.zeros(1, device=torch.device("cuda", index))
        self.receive(probe, None)
        torch.cuda.synchronize(self.device)
        torch.cuda.synchronize(index)
        return self.peer_access.get(index, False)

    def receive(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> Received:
        """`src` on this transport's device. `ready` is the producer's event
        recorded after the work that wrote `src`; None means `src` is complete
        with respect to its device's current stream in this thread (usually the
        default stream). Never blocks the host."""
        if src.device == self.device:
            if ready is not None and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).wait_event(ready)
            return Received(src)
        if src.device.type == "cuda":
            if self.device.type == "cuda":
                return self._device_to_device(src, ready)
            if self.device.type == "cpu":
                return self._device_to_host(src, ready)
        elif src.device.type == "cpu" and self.device.type == "cuda":
            return self._host_to_device(src, ready)
        raise ValueError(f"Transport to {self.device} cannot receive from {src.device}")

    def _device_to_device(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> Received:
        assert self.stream is not None
        consumer = torch.cuda.current_stream(self.device)
        side = self._side_stream(src.device.index)
        side.wait_event(ready if ready is not None else torch.cuda.current_stream(src.device).record_event())
        # both devices' current streams are ours inside: torch's two-way barrier for a cross-device copy then
        # joins the side stream and the transfer stream only, never the producer's or the consumer's streams
        with torch.cuda.stream(self.stream), torch.cuda.stream(side):
            # allocated on the transfer stream: its memory's previous users are ordered before it
            out = torch.empty_like(src, device=self.device)
            out.copy_(src, non_blocking=True)  # issued on `side`; the transfer stream then waits for it
            done = self.stream.record_event()
        src.record_stream(side)       # the producer may free src now: its memory waits for the copy
        consumer.wait_event(done)
        out.record_stream(consumer)   # freed after the consumer's use, not after the transfer stream's
        return Received(out, done)

    def _host_to_device(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> Received:
        assert self.stream is not None
        consumer = torch.cuda.current_stream(self.device)
        # a copy from pageable memory (or a non-contiguous one, which torch stages through pageable memory)
        # waits for the stream on the host: stage it contiguous in torch's pinned pool, which keeps the block
        # until the copy ran. A pinned contiguous source is used directly: the caller keeps it until `done`.
        if src.is_pinned() and src.is_contiguous():
            staged = src
        else:
            staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)  # e.g. src is being filled by an async device-to-host copy
            out = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
            out.copy_(staged, non_blocking=True)
            done = self.stream.record_event()
        consumer.wait_event(done)
        out.record_stream(consumer)
        return Received(out, done)

    def _device_to_host(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> Received:
        side = self._side_stream(src.device.index)
        side.wait_event(ready if ready is not None else torch.cuda.current_stream(src.device).record_event())
        with torch.cuda.stream(side):
            # from torch's pinned pool, which holds the block until the copy ran even if `out` is dropped
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out.copy_(src, non_blocking=True)
            done = side.record_event()
        src.record_stream(side)
        return Received(out, done)
