"""The CUDA stream a component's decode groups run on, beside the worker's.

A group's steps and the updates of its tensors go on it, so that one
component's decode overlaps another's (a talker's frame beside a thinker's
token). What crosses between the two streams is ordered here: a step waits
for what the worker's stream queued before it (the rows' prefills, swapped-in
KV, item steps of the same component); the worker's stream waits for it
before a KV item step and when rows are handed back out of a group; tensors
made on one and read on the other are marked as used there, so that their
memory is not reused under work still queued. Without CUDA it does nothing.
"""

from __future__ import annotations

import contextlib

import torch


class GroupStream:
    def __init__(self, stream: torch.cuda.Stream | None, device: torch.device) -> None:
        self.stream = stream
        self.worker = torch.cuda.current_stream(device) if stream is not None else None

    def on(self) -> contextlib.AbstractContextManager:
        """Work queued inside goes on the group's stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def after_worker(self) -> None:
        """The group's stream waits for the work the worker's stream queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(self.worker)

    def worker_waits(self) -> None:
        """The worker's stream waits for the work the group's stream queued so far."""
        if self.stream is not None:
            self.worker.wait_stream(self.stream)

    def handed_out(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, made on the group's stream, is read on the worker's."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.worker)
        return t

    def taken_in(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, made on the worker's stream, is read on the group's."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)
        return t
