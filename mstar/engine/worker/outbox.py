"""What a worker has for the event loop, in order: emits whose host copies
may still be in flight, and finished partitions queued behind them.

A plain step (the codec's window, say) does not wait for its device work:
its emitted rows are copied to page-locked host memory without blocking, and
the copy's event says when they can be read. Reports must keep each
request's order (every audio chunk before the request's end), so once one
emit waits, everything after it waits too; `release` moves the ready prefix
into the step report.
"""

from __future__ import annotations

from collections import deque

import torch

from mstar.engine.messages import Awaiting, EmitBatch, Finished, StepReport
from mstar.engine.movement.arena import HostArena, stage_to_host
from mstar.engine.movement.transfer import select_rows


class Outbox:
    def __init__(self) -> None:
        self._held: deque[tuple[torch.cuda.Event | None, EmitBatch | Finished | Awaiting]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def emit(self, report: StepReport, batch: EmitBatch, ready: torch.cuda.Event | None = None) -> None:
        """`batch` into `report`, or held behind what is still in flight.
        `ready`: recorded after the copy that fills `batch.data`."""
        if ready is None and not self._held:
            report.emits.append(batch)
        else:
            self._held.append((ready, batch))

    def emit_rows(self, report: StepReport, name: str, host: torch.Tensor, idx: list[int] | None, rids: list[str],
                  partitions: list[str], logprobs: torch.Tensor | None = None) -> None:
        """Rows `idx` (None: all) of `host`, a step's output `name` already on
        the host (a group's tokens), to their clients."""
        if idx is None:
            self.emit(report, EmitBatch(name, rids, partitions, host, logprobs=logprobs))
            return
        self.emit(report, EmitBatch(name, [rids[i] for i in idx], [partitions[i] for i in idx], host[idx],
                                    logprobs=None if logprobs is None else logprobs[idx]))

    def stage_rows(self, report: StepReport, arena: HostArena | None, name: str,
                   data: torch.Tensor | list[torch.Tensor], idx: list[int], rids: list[str], partitions: list[str],
                   logprobs: torch.Tensor | None = None) -> None:
        """Rows `idx` of a step's output `name` to their clients, copied to the
        host without waiting (into `arena`, freed once the engine read them):
        they reach the report once the copy has run."""
        rows = [data[i] for i in idx] if isinstance(data, list) else select_rows(data.detach(), idx)
        host, ready, blocks = stage_to_host(rows, arena, stage_cpu=True)
        self.emit(report, EmitBatch(name, [rids[i] for i in idx], [partitions[i] for i in idx], host, blocks,
                                    None if logprobs is None else logprobs[idx]), ready)

    def finished(self, report: StepReport, fin: Finished | Awaiting) -> None:
        """A partition's end (or a request's wait for input), behind its emits."""
        if self._held:
            self._held.append((None, fin))
        else:
            _after(report, fin)

    def release(self, report: StepReport, wait: bool = False) -> None:
        """Move what is ready (with `wait`: everything) into `report`, in order."""
        while self._held:
            ready, item = self._held[0]
            if ready is not None and not ready.query():
                if not wait:
                    return
                ready.synchronize()
            self._held.popleft()
            if isinstance(item, EmitBatch):
                report.emits.append(item)
            else:
                _after(report, item)


def _after(report: StepReport, item: Finished | Awaiting) -> None:
    (report.awaiting if isinstance(item, Awaiting) else report.finished).append(item)
